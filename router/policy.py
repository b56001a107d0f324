"""Routing policy: which node prefills a prompt and which decodes it. Pure Python over plain data, no I/O.

Score (lower is better), in *token equivalents*: the prefill work one prompt token costs is 1.
- The prefix: hits(N) = the leading prompt blocks node N holds (from the index lookup). The score counts a
  block the prefilling node lacks as its block_size tokens of compute: tokens_to_compute(P) =
  max(1, prompt_tokens - hits(P) * block_size). A fetch path exists but is not scored here: once the
  pair is chosen, router/routing.py has the prefilling node fetch the leading blocks another node holds
  beyond its own (node/kv_fetch.py), and with `--cost-model` router/cost_model.py weighs fetching
  against computing.
- Prefill node P:  queued_prefill_tokens(P) * queue_token_weight + tokens_to_compute(P)
  (work queued ahead of this request delays it as much as its own compute does.)
- Decode node D:   blocks_to_transfer(D) * transfer_block_cost + running(D) * decode_running_cost
                   + kv_use_after(D) * kv_pressure_cost
  where blocks_to_transfer = ceil(prompt_tokens / block_size) - hits(D) (blocks D holds are not sent) and
  kv_use_after = (kv_used + blocks_to_transfer) / kv_total, a fraction from 0 to 1 (0 when unknown).
  A D without room for the prompt's blocks ranks after every D with room.
- Single node S (one node does both): the P score plus the D terms for running and KV use.
P and D are chosen independently (the score is separable). Draining nodes get no new work. Ties in score
break on fewer running + waiting requests, then on `rotation` (a counter the caller advances) to spread load.
Mode order: prefill+decode pools both non-empty -> "disaggregated" (or "local_prefill" on D when the tokens D
would compute are <= local_prefill_max_tokens); else single nodes -> "single"; else decode nodes only ->
"local_prefill"; else NoNodeAvailable. The weights are estimates to be calibrated by benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pdserve.shared.index.block_index_types import NodeStatus
from pdserve.shared.types import ROLES, NodeId, Role

Mode = Literal["disaggregated", "local_prefill", "single"]


class NoNodeAvailable(Exception):
    """No live, non-draining node can take the request."""


@dataclass(frozen=True)
class PolicyConfig:
    queue_token_weight: float = 1.0
    transfer_block_cost: float = 0.5
    """Token equivalents to send one block P -> D (mostly overlapped with compute)."""
    decode_running_cost: float = 16.0
    kv_pressure_cost: float = 256.0
    local_prefill_max_tokens: int = 0
    """Prefill on D itself when D would compute at most this many tokens (0: never while P nodes exist)."""

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens={self.local_prefill_max_tokens} must be >= 0")
        weights = (self.queue_token_weight, self.transfer_block_cost)
        if min((*weights, self.decode_running_cost, self.kv_pressure_cost)) < 0:
            raise ValueError(f"policy weights must be >= 0, got {self}")


@dataclass(frozen=True)
class NodeView:
    """What the policy needs to know of one live node."""

    node_id: NodeId
    role: Role
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    draining: bool = False

    @classmethod
    def from_status(cls, status: NodeStatus) -> NodeView:
        load = status.load
        if load is None:
            return cls(status.info.node_id, status.info.role, draining=status.draining)
        return cls(
            status.info.node_id,
            status.info.role,
            running=load.running,
            waiting=load.waiting,
            queued_prefill_tokens=load.queued_prefill_tokens,
            kv_used_blocks=load.kv_used_blocks,
            kv_total_blocks=load.kv_total_blocks,
            draining=status.draining,
        )


@dataclass(frozen=True)
class Decision:
    """Where a request goes and what the policy expects it to cost (exported as metrics)."""

    mode: Mode
    prefill: NodeId
    decode: NodeId
    tokens_to_compute: int
    """Estimated prompt tokens the prefilling node computes (its uncached blocks, at least 1 token)."""
    blocks_to_transfer: int
    cached_blocks_prefill: int
    cached_blocks_decode: int
    score: float


@dataclass(frozen=True)
class _Prompt:
    tokens: int
    hits: Mapping[NodeId, int]
    block_size: int


def _prefill_terms(cfg: PolicyConfig, p: _Prompt, node: NodeView) -> tuple[float, int]:
    """(score, tokens_to_compute) of prefilling on node: its queue plus every block it lacks, computed."""
    compute = max(1, p.tokens - p.hits.get(node.node_id, 0) * p.block_size)
    return node.queued_prefill_tokens * cfg.queue_token_weight + compute, compute


def _decode_terms(cfg: PolicyConfig, node: NodeView, new_blocks: int, sent_blocks: int) -> tuple[bool, float]:
    """(lacks room, score) of decoding on node after it allocates new_blocks, sent_blocks of them from P."""
    use = 0.0
    full = False
    if node.kv_total_blocks > 0:
        use = min(1.0, (node.kv_used_blocks + new_blocks) / node.kv_total_blocks)
        full = node.kv_used_blocks + new_blocks > node.kv_total_blocks
    score = sent_blocks * cfg.transfer_block_cost + node.running * cfg.decode_running_cost
    return full, score + use * cfg.kv_pressure_cost


def _pick(
    nodes: Sequence[NodeView], key: Callable[[NodeView], tuple[bool, float]], rotation: int
) -> NodeView:
    ranked = sorted(((*key(n), n.running + n.waiting, n.node_id), n) for n in nodes)
    best = ranked[0][0][:3]
    tied = [n for k, n in ranked if k[:3] == best]
    return tied[rotation % len(tied)]


def choose(
    prompt_blocks: int,
    prompt_tokens: int,
    prefix_hits: Mapping[NodeId, int],
    nodes: Sequence[NodeView],
    config: PolicyConfig | None = None,
    rotation: int = 0,
    *,
    block_size: int,
) -> Decision:
    """Pick the prefill and decode nodes for a prompt of prompt_tokens tokens (prompt_blocks full blocks of
    block_size tokens: the KV block size the nodes registered).

    prefix_hits: per node, leading prompt blocks it holds (BlockIndex.lookup; {} when the index is down).
    """
    cfg = config or PolicyConfig()
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if prompt_tokens < 1 or not 0 <= prompt_blocks <= prompt_tokens // block_size:
        raise ValueError(
            f"prompt_tokens={prompt_tokens}, prompt_blocks={prompt_blocks}: need tokens >= 1 and "
            f"0 <= blocks <= tokens // block_size ({block_size})"
        )
    usable = [n for n in nodes if not n.draining]
    ids = {n.node_id for n in usable}
    hits = {k: min(v, prompt_blocks) for k, v in prefix_hits.items() if k in ids and v > 0}
    p = _Prompt(prompt_tokens, hits, block_size)
    pool = {r: [n for n in usable if n.role == r] for r in ROLES}
    needed = -(-prompt_tokens // block_size)

    def new_blocks(n: NodeView) -> int:
        return needed - p.hits.get(n.node_id, 0)

    if pool["decode"] and (pool["prefill"] or not pool["single"]):
        d = _pick(pool["decode"], lambda n: _decode_terms(cfg, n, new_blocks(n), new_blocks(n)), rotation)
        score, compute = _prefill_terms(cfg, p, d)
        if not pool["prefill"] or compute <= cfg.local_prefill_max_tokens:
            score += _decode_terms(cfg, d, new_blocks(d), 0)[1]
            return _decision("local_prefill", d, d, p, compute, 0, score)
        pn = _pick(pool["prefill"], lambda n: (False, _prefill_terms(cfg, p, n)[0]), rotation)
        score, compute = _prefill_terms(cfg, p, pn)
        score += _decode_terms(cfg, d, new_blocks(d), new_blocks(d))[1]
        return _decision("disaggregated", pn, d, p, compute, new_blocks(d), score)
    if pool["single"]:

        def single_key(n: NodeView) -> tuple[bool, float]:
            full, d_score = _decode_terms(cfg, n, new_blocks(n), 0)
            return full, _prefill_terms(cfg, p, n)[0] + d_score

        s = _pick(pool["single"], single_key, rotation)
        return _decision("single", s, s, p, _prefill_terms(cfg, p, s)[1], 0, single_key(s)[1])
    seen = ", ".join(f"{n.node_id} ({n.role}{', draining' if n.draining else ''})" for n in nodes) or "none"
    raise NoNodeAvailable(
        f"no node can take the request: need a decode or single node that is not draining; live: {seen}"
    )


def _decision(
    mode: Mode, pn: NodeView, d: NodeView, p: _Prompt, compute: int, transfer: int, score: float
) -> Decision:
    return Decision(
        mode=mode,
        prefill=pn.node_id,
        decode=d.node_id,
        tokens_to_compute=compute,
        blocks_to_transfer=transfer,
        cached_blocks_prefill=p.hits.get(pn.node_id, 0),
        cached_blocks_decode=p.hits.get(d.node_id, 0),
        score=score,
    )
