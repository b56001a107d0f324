"""The internal router <-> node messages (HTTP control plane), version 3 (2: prompt token ids travel packed,
as little-endian uint32 in lowercase hex: shared/wire.py's U32Ids; 3: the requests carry the request's W3C
trace context, `trace_context`, written and read by OpenTelemetry's propagator: shared/tracing.py).

Endpoints on every node: `POST /internal/generate` (body NodeGenerateRequest; reply an NDJSON stream, one
StepOutput line per engine step, the last one carrying finish_reason), `POST /internal/prefill` (body
PrefillRequest; reply PrefillResult), `POST /internal/export` (body ExportRequest from a fetching node;
reply ExportResult: the holder pushed the prefix blocks it still has over the KV-transfer protocol),
`POST /internal/abort` (body AbortRequest), `GET /internal/info` (reply NodeInfoReply). Encoding: one JSON
object per message with `"v": PROTOCOL_VERSION`, through the one
codec (shared/wire.py), which refuses any other version, any unknown field and any field of the wrong type,
naming it, with a `WireError` (a ValueError). Invariants: messages are frozen and valid
once built; `deadline` is absolute unix seconds (the ONE deadline of the request, shared by every node);
logprobs are finite floats >= -9999.0 (OpenAI's floor: -inf is clamped when built, NaN is refused). A top
logprob entry travels as the JSON array [token text, token id, logprob, bytes]. Connections: the router drops
an idle pooled connection after CLIENT_KEEPALIVE_S and a node keeps one open for NODE_KEEPALIVE_S, which is
longer, so the router never reuses a connection the node is closing (that race cut requests with a bare
ReadError when both sides used 5 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import FINISH_REASONS, ROLES, FinishReason, NodeId, RequestId, Role
from pdserve.shared.wire import Codec, JsonMessage, U32Ids, local

PROTOCOL_VERSION = 3
CODEC = Codec("node protocol", PROTOCOL_VERSION)
CLIENT_KEEPALIVE_S = 5.0  # the router's pools drop a connection idle this long
NODE_KEEPALIVE_S = 65  # a node's HTTP server closes a connection idle this long: beyond CLIENT_KEEPALIVE_S
LOGPROB_FLOOR = -9999.0


class _Message(JsonMessage):
    """A node-protocol message."""

    codec = CODEC


def _check_token_ids(name: str, ids: tuple[int, ...], allow_empty: bool) -> None:
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    if ids and (lowest := min(ids)) < 0:  # min: one C-level pass (a prompt may hold 100k ids)
        raise ValueError(f"{name} holds negative token ids, e.g. {lowest}")


def _check_deadline(deadline: float) -> None:
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"deadline must be positive unix seconds, got {deadline!r}")


@dataclass(frozen=True)
class _PromptRequest(_Message):
    """Router -> node, a prompt to work on: the fields and checks NodeGenerateRequest and PrefillRequest
    share (each adds its own after them)."""

    request_id: RequestId
    prompt_token_ids: U32Ids
    sampling: SamplingParams
    cache_salt: str | None
    deadline: float

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id is empty")
        _check_deadline(self.deadline)
        _check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)


@dataclass(frozen=True)
class NodeGenerateRequest(_PromptRequest):
    """Router -> decode (or single) node. prefill_node_id None: compute the prompt locally."""

    prefill_node_id: NodeId | None = None
    fetch_from_url: str | None = None
    """Only when this node computes the prompt (prefill_node_id None): the internal URL of a node the index
    says holds `fetch_blocks` leading prompt blocks this node lacks; fetch them from it first (the cost
    model's `local_fetch`)."""
    fetch_blocks: int = 0
    trace_context: dict[str, str] | None = None
    """The request's W3C trace context (`traceparent`, `tracestate`); None while the router does not trace."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fetch(self.fetch_from_url, self.fetch_blocks)
        if self.fetch_from_url is not None and self.prefill_node_id is not None:
            raise ValueError(
                "fetch_from_url names a holder for a prompt this node computes: no prefill_node_id"
            )


def _check_fetch(url: str | None, blocks: int) -> None:
    if blocks < 0 or (blocks > 0) != bool(url):
        raise ValueError(f"fetch_blocks {blocks} must be > 0 exactly when fetch_from_url is set ({url!r})")


@dataclass(frozen=True)
class PrefillRequest(_PromptRequest):
    """Router -> prefill node: compute the prompt, sample the first token, send the KV to the decode node."""

    decode_node_id: NodeId
    decode_transfer_addr: str
    fetch_from_url: str | None = None
    """The internal URL of a node the index says holds `fetch_blocks` leading prompt blocks this prefill node
    lacks: fetch them from it (ExportRequest) before computing; None: compute what is not cached here."""
    fetch_blocks: int = 0
    trace_context: dict[str, str] | None = None
    """The request's W3C trace context, as NodeGenerateRequest's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.decode_node_id or not self.decode_transfer_addr:
            raise ValueError(
                f"decode_node_id {self.decode_node_id!r} and decode_transfer_addr "
                f"{self.decode_transfer_addr!r} must both be set"
            )
        _check_fetch(self.fetch_from_url, self.fetch_blocks)


@dataclass(frozen=True)
class ExportRequest(_Message):
    """Fetching node -> holder: push the longest prefix of `block_hashes` you hold to `fetcher_transfer_addr`
    as KV transfer `transfer_id` (the fetcher's receiver answers its OPEN with the blocks it already has)."""

    transfer_id: RequestId
    block_hashes: tuple[bytes, ...]
    fetcher_transfer_addr: str
    deadline: float

    def __post_init__(self) -> None:
        if not self.transfer_id:
            raise ValueError("transfer_id is empty")
        _check_deadline(self.deadline)
        if not self.block_hashes or any(len(h) != 32 for h in self.block_hashes):
            raise ValueError("block_hashes must be a non-empty list of 32-byte hashes")
        if not self.fetcher_transfer_addr:
            raise ValueError("fetcher_transfer_addr is empty")


@dataclass(frozen=True)
class ExportResult(_Message):
    """Holder -> fetching node: `held_blocks` leading blocks were still here (fewer than asked: the index
    was stale), `sent_blocks` of them went out (the fetcher had the others). error None: it completed."""

    held_blocks: int
    sent_blocks: int
    error: str | None = None


@dataclass(frozen=True)
class PrefillResult(_Message):
    """Prefill node -> router. error None: the KV reached the decode node. Counts: tokens, blocks.
    decode_computes: the transfer failed after the decode node took it, so that node computes the prompt
    itself (or fails the request, by its kv_load_failure_policy): its stream says how the request ends."""

    request_id: RequestId
    first_token: int | None
    computed_tokens: int
    cached_tokens: int
    transferred_blocks: int
    error: str | None = None
    decode_computes: bool = False
    fetched_tokens: int = 0
    """Of cached_tokens, those fetched from another node for this request (the router's "remote" hits)."""
    fetch_seconds: float = 0.0
    compute_seconds: float = 0.0
    """The engine's prefill, from its first step for the request to the first token."""
    transfer_seconds: float = 0.0
    """The transfer to D, from its first DATA frame to D's acknowledgement (overlapping the compute)."""
    transfer_tail_seconds: float = 0.0
    """The part of the transfer not hidden under the compute: from the first token to D's acknowledgement."""

    def __post_init__(self) -> None:
        if self.error is None and self.first_token is None:
            raise ValueError("a successful PrefillResult needs first_token")
        for name in ("computed_tokens", "cached_tokens", "transferred_blocks", "fetched_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is negative: {getattr(self, name)}")


def _clamp(logprob: float) -> float:
    if math.isnan(logprob):
        raise ValueError("logprob is NaN")
    return max(logprob, LOGPROB_FLOOR)


def _check_bytes(value: tuple[int, ...] | None) -> None:
    if value is not None and any(not 0 <= b < 256 for b in value):
        raise ValueError(f"bytes out of range 0..255: {value!r}")


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a position (on the wire the array [token, token_id, logprob,
    bytes]). bytes: the token's UTF-8 bytes, or None. Checked and clamped by the TokenLogprob holding it."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] | None


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position, its logprob, and the top-N alternatives (N = sampling.logprobs)."""

    token_id: int
    token: str
    logprob: float
    bytes: tuple[int, ...] | None
    top: tuple[TopLogprob, ...] = ()

    def __post_init__(self) -> None:
        _check_bytes(self.bytes)
        for t in self.top:
            _check_bytes(t.bytes)
        if not self.logprob >= LOGPROB_FLOOR:  # -inf or NaN (a comparison with NaN is False)
            object.__setattr__(self, "logprob", _clamp(self.logprob))
        if not all(t.logprob >= LOGPROB_FLOOR for t in self.top):
            object.__setattr__(self, "top", tuple(t._replace(logprob=_clamp(t.logprob)) for t in self.top))


ENGINE_FAILURE = "engine or transfer failure"


@dataclass(frozen=True)
class StepOutput(_Message):
    """What one engine step produced for one request (the engine's output), and the node -> router NDJSON
    line that carries it. `text` is the new text since the previous output; counts are cumulative for the
    request. `arrival_time` and `scheduled_time` are the node's own time.monotonic() readings (when the
    request was built; when this engine first computed it, None: not yet, or its prompt came remotely) and
    never travel."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    migrate: bool = False
    """The node ended the request to move it (a drain with --migrate; finish_reason "abort"): the router
    continues it on another node from the tokens already streamed, fetching its KV from this node."""
    arrival_time: float = local(0.0)
    scheduled_time: float | None = local(None)

    @classmethod
    def failed(cls, request_id: RequestId, prompt_tokens: int, error: str = ENGINE_FAILURE) -> StepOutput:
        """The last output of a request that ended in error, saying why."""
        return cls(request_id, (), "", None, "error", prompt_tokens, 0, 0, error)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} new tokens")
        if self.error is not None and self.finish_reason not in ("abort", "error"):
            raise ValueError(f"error set but finish_reason is {self.finish_reason!r}")
        if self.migrate and self.finish_reason != "abort":
            raise ValueError(f"migrate set but finish_reason is {self.finish_reason!r} (a move is an abort)")
        _check_token_ids("token_ids", self.token_ids, allow_empty=True)

    def to_line(self) -> bytes:
        return self.to_json() + b"\n"

    @classmethod
    def from_line(cls, data: bytes | str) -> StepOutput:
        return cls.from_json(data)


@dataclass(frozen=True)
class AbortRequest(_Message):
    """Router -> any node the request touched: stop it and free everything it holds. Idempotent."""

    request_id: RequestId


@dataclass(frozen=True)
class RoleChangeRequest(_Message):
    """kvctl (or the planner) -> a node: serve as `role` from now on (node/role_change.py). `migrate`: end
    its running decodes so that the router continues them on other nodes, instead of letting them finish."""

    role: Role
    migrate: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class ChallengeRequest(_Message):
    """Router -> a node's URL, once per (node id, epoch) before any work: prove you hold the credential."""

    nonce: str
    """32 hex digits, fresh per challenge."""


@dataclass(frozen=True)
class ChallengeReply(_Message):
    """Node -> router: `answer` is shared/node/node_sign.py's challenge MAC over (nonce, node_id, epoch)."""

    node_id: NodeId
    epoch: int
    answer: str


@dataclass(frozen=True)
class NodeInfoReply(_Message):
    """Node -> router: who the node is and the limits the router checks requests against."""

    node_id: NodeId
    role: Role
    model: str
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.max_model_len <= 0 or self.block_size <= 0:
            raise ValueError(
                f"max_model_len {self.max_model_len} and block_size {self.block_size} must be > 0"
            )
