"""The planner's model: from a load, measured node rates and the SLOs, how many prefill and decode nodes the
load needs, and which of the current nodes should change role. Pure Python over plain data; no I/O, no clock.

Invariants: a decision never leaves a role empty (each keeps one node at least), acts on no view that lacks
a role (a node that missed its heartbeats must not look like a missing role), and never changes a node
whose last role change is younger than the dwell time; it moves nodes only when every round of the
stabilisation window asks for a move the same way and the nearest of their ideal prefill counts is past the
rounding point by the hysteresis margin, so neither a load between two splits nor one noisy round flaps
the cluster; no load means no change. Units: seconds, tokens, requests per second.

The sizing, per role (the estimates DistServe and Dynamo's planner make, in their simplest form):
- prefill: one request's service time s = prompt tokens / a node's prefill tokens per busy second; a node
  queues like M/M/1, so its TTFT is about s / (1 - u) at utilisation u, and the SLO allows u <= 1 - s / TTFT;
  prefill nodes = prefill tokens per second / (rate per node * that utilisation);
- decode: a step of b sequences takes a + c * b seconds (a: reading the weights, c: one sequence's KV and
  compute), so the TPOT SLO allows b <= (TPOT - a) / c sequences per node, and the node's slots allow
  b <= slots (its --max-num-seqs, and the streams its KV holds: a request that finds no slot waits before its
  first token); a node makes b / (a + c * b) tokens per second; decode nodes = output tokens per second /
  that (by Little's law, the streams in flight over the slots when the slots bind).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

PlanRole = Literal["prefill", "decode"]
MIN_UTILISATION = 0.05
"""The utilisation a prefill node is planned at when one prompt alone takes about the TTFT SLO or more (the
SLO cannot be met: size for throughput with a large margin, and say so)."""


@dataclass(frozen=True)
class Load:
    """The arrival rate (requests/s) and the mean prompt tokens each request makes a prefill node compute
    (prefix hits excluded) and output tokens it generates."""

    rate: float
    prompt_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class Rates:
    """One node's measured (or prior) speed: prefill tokens per busy second; a decode step's seconds as
    `decode_step_s + decode_step_s_per_seq * batch`."""

    prefill_tokens_per_s: float
    decode_step_s: float
    decode_step_s_per_seq: float


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Damping:
    """`margin`: how far (in nodes) past the rounding point the ideal split must be before nodes move;
    `dwell_s`: the least time between two role changes of one node; `stabilize_s`: the window of recent
    rounds whose ideals must all ask for the move (the loop keeps them; `decide` takes them as `recent`)."""

    margin: float = 0.25
    dwell_s: float = 300.0
    stabilize_s: float = 60.0


@dataclass(frozen=True)
class Need:
    """Nodes the load needs per role (fractional, before rounding), and whether each SLO can be met at all."""

    prefill: float
    decode: float
    prefill_utilisation: float
    decode_batch: float
    ttft_feasible: bool
    tpot_feasible: bool

    def desired(self) -> dict[PlanRole, int]:
        """Whole nodes per role (at least one each): what an autoscaler should run."""
        return {"prefill": max(1, math.ceil(self.prefill)), "decode": max(1, math.ceil(self.decode))}


@dataclass(frozen=True)
class NodeView:
    """A node the planner may move: its role now, its requests in flight, and when it last changed role
    (seconds on the planner's clock; None: not since the planner started)."""

    node_id: str
    role: PlanRole
    running: int
    changed_at: float | None


@dataclass(frozen=True)
class RoleChange:
    node_id: str
    to: PlanRole


@dataclass(frozen=True)
class Decision:
    """The split the load asks of the current nodes and the changes that move toward it. `reason` says why
    nothing (or less than asked) moved: `idle`, `balanced`, `hysteresis`, `too_few_nodes`, `role_missing`
    (no live node of one role: the view is partial, act on none of it), `dwell` or `move`."""

    desired: dict[PlanRole, int]
    ideal_prefill: float
    steady_prefill: float
    """The ideal a move acts on: of this and the recent rounds' ideals, the nearest to the current count."""
    target_prefill: int
    changes: tuple[RoleChange, ...]
    reason: str


def decode_slots(load: Load, max_num_seqs: int, capacity_blocks: int, block_size: int) -> int:
    """The sequences one decode node can run at once for `load`: its max_num_seqs (0: not known, from a node
    that predates it) and the streams its pool of `capacity_blocks` holds, each its computed prompt tokens
    (a prefix hit's blocks are shared) and its output tokens; one at least."""
    per_stream = math.ceil((load.prompt_tokens + load.output_tokens) / block_size)
    by_kv = capacity_blocks // per_stream if per_stream > 0 else capacity_blocks
    return max(1, min(by_kv, max_num_seqs or by_kv))


def need(load: Load, rates: Rates, slo: Slo, slots: float = math.inf) -> Need:
    """The nodes `load` needs at `rates` under `slo`, a decode node running `slots` sequences at most
    (`decode_slots`; estimates, see the module's docstring)."""
    assert rates.prefill_tokens_per_s > 0 and rates.decode_step_s > 0 and rates.decode_step_s_per_seq > 0
    service_s = load.prompt_tokens / rates.prefill_tokens_per_s
    utilisation = 1.0 - service_s / slo.ttft_s
    ttft_ok = utilisation >= MIN_UTILISATION
    utilisation = max(MIN_UTILISATION, min(1.0, utilisation))
    prefill = load.rate * load.prompt_tokens / (rates.prefill_tokens_per_s * utilisation)
    batch = (slo.tpot_s - rates.decode_step_s) / rates.decode_step_s_per_seq
    tpot_ok = batch >= 1.0
    batch = max(1.0, min(batch, slots))
    decode_tokens_per_s = batch / (rates.decode_step_s + rates.decode_step_s_per_seq * batch)
    decode = load.rate * load.output_tokens / decode_tokens_per_s
    return Need(prefill, decode, utilisation, batch, ttft_ok, tpot_ok)


def steady(ideals: Sequence[float], current: int) -> float:
    """The ideal prefill count a move may act on (an autoscaler's stabilisation window): of the recent rounds'
    ideals, the nearest to `current`, or `current` itself when they lie on both sides of it."""
    if min(ideals) <= current <= max(ideals):
        return float(current)
    return min(ideals, key=lambda x: abs(x - current))


def decide(
    needed: Need, nodes: Sequence[NodeView], damping: Damping, now: float, recent: Sequence[float] = ()
) -> Decision:
    """Which of `nodes` change role now, toward the split of them that `needed` asks for; `recent`: the ideal
    prefill counts of the rounds within the stabilisation window before this one."""
    desired = needed.desired()
    current = sum(1 for n in nodes if n.role == "prefill")
    total = needed.prefill + needed.decode
    if total <= 0:
        return Decision(desired, float(current), float(current), current, (), "idle")
    ideal = len(nodes) * needed.prefill / total
    if len(nodes) < 2:
        return Decision(desired, ideal, ideal, current, (), "too_few_nodes")
    if current in (0, len(nodes)):  # a node of the other role missed its heartbeats, or is mid-change
        return Decision(desired, ideal, ideal, current, (), "role_missing")
    held = steady([*recent, ideal], current)
    target = min(max(round(held), 1), len(nodes) - 1)
    if target == current:
        return Decision(desired, ideal, held, target, (), "balanced")
    if abs(held - current) < 0.5 + damping.margin:
        return Decision(desired, ideal, held, current, (), "hysteresis")
    source: PlanRole = "decode" if target > current else "prefill"
    to: PlanRole = "prefill" if source == "decode" else "decode"
    eligible = sorted(
        (n for n in nodes
         if n.role == source and (n.changed_at is None or now - n.changed_at >= damping.dwell_s)),
        key=lambda n: (n.running, n.node_id),
    )  # fmt: skip
    moves = eligible[: abs(target - current)]
    reason = "move" if len(moves) == abs(target - current) else "dwell"
    return Decision(desired, ideal, held, target, tuple(RoleChange(n.node_id, to) for n in moves), reason)


def inputs_record(
    load: Load,
    rates: Rates,
    slo: Slo,
    needed: Need,
    decision: Decision,
    nodes: Mapping[str, PlanRole],
    slots: float = math.inf,
) -> dict[str, object]:
    """One decision with everything it was made from, as the planner logs it (one JSON line)."""
    return {
        "load": vars(load), "rates": vars(rates), "slo": vars(slo),
        "decode_slots": slots if math.isfinite(slots) else None,
        "need": {"prefill": round(needed.prefill, 3), "decode": round(needed.decode, 3),
                 "prefill_utilisation": round(needed.prefill_utilisation, 3),
                 "decode_batch": round(needed.decode_batch, 2),
                 "ttft_feasible": needed.ttft_feasible, "tpot_feasible": needed.tpot_feasible},
        "nodes": dict(nodes), "desired": decision.desired, "ideal_prefill": round(decision.ideal_prefill, 3),
        "steady_prefill": round(decision.steady_prefill, 3),
        "target_prefill": decision.target_prefill, "reason": decision.reason,
        "changes": [{"node_id": c.node_id, "to": c.to} for c in decision.changes],
    }  # fmt: skip
