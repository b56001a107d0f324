"""The internal router <-> node messages (HTTP control plane), version 1.

Endpoints on every node: `POST /internal/generate` (body NodeGenerateRequest; reply an NDJSON stream, one
StepOutput line per engine step, the last one carrying finish_reason), `POST /internal/prefill` (body
PrefillRequest; reply PrefillResult), `POST /internal/export` (body ExportRequest from a fetching node; reply
ExportResult: the holder pushed the prefix blocks it still has over the KV-transfer protocol),
`POST /internal/abort` (body AbortRequest), `GET /internal/info` (reply NodeInfoReply). Encoding: one JSON
object per message with `"v": PROTOCOL_VERSION`; a decoder refuses
any other version and any field of the wrong type, naming it. Invariants: messages are frozen and valid
once built; `deadline` is absolute unix seconds (the ONE deadline of the request, shared by every node);
logprobs are finite floats >= -9999.0 (OpenAI's floor: -inf is clamped on encode, NaN is refused). A top
logprob entry travels as the JSON array [token text, token id, logprob, bytes]. Connections: the router drops
an idle pooled connection after CLIENT_KEEPALIVE_S and a node keeps one open for NODE_KEEPALIVE_S, which is
longer, so the router never reuses a connection the node is closing (that race cut requests with a bare
ReadError when both sides used 5 s).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import NodeId, RequestId

PROTOCOL_VERSION = 1
CLIENT_KEEPALIVE_S = 5.0  # the router's pools drop a connection idle this long
NODE_KEEPALIVE_S = 65  # a node's HTTP server closes a connection idle this long: beyond CLIENT_KEEPALIVE_S
LOGPROB_FLOOR = -9999.0
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
NodeRole = Literal["prefill", "decode", "single"]
NODE_ROLES: tuple[str, ...] = ("prefill", "decode", "single")

_T = TypeVar("_T")


def _field(d: dict[str, Any], key: str, kind: type[_T] | tuple[type, ...], optional: bool = False) -> _T:
    if key not in d:
        if optional:
            return cast(_T, None)
        raise ValueError(f"missing field {key!r}")
    value = d[key]
    if value is None and optional:
        return cast(_T, None)
    # bool is an int subclass: refuse it where a number is expected.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ValueError(f"field {key!r} has type {type(value).__name__}, expected {kind}")
    return cast(_T, value)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _int_list(d: dict[str, Any], key: str) -> tuple[int, ...]:
    values = _field(d, key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"field {key!r} must be a list of ints")
    return tuple(values)


def _decode(data: bytes | str, kind: str) -> dict[str, Any]:
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"{kind}: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ValueError(f"{kind}: protocol version {version!r} is not {PROTOCOL_VERSION}")
    return obj


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **obj}, allow_nan=False, separators=(",", ":")).encode()


def _check_token_ids(name: str, ids: tuple[int, ...], allow_empty: bool) -> None:
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    bad = [t for t in ids if t < 0]
    if bad:
        raise ValueError(f"{name} holds negative token ids, e.g. {bad[0]}")


def _check_request(request_id: str, deadline: float) -> None:
    if not request_id:
        raise ValueError("request_id is empty")
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"deadline must be positive unix seconds, got {deadline!r}")


@dataclass(frozen=True)
class NodeGenerateRequest:
    """Router -> decode (or single) node. prefill_node_id None: compute the prompt locally."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None
    deadline: float
    prefill_node_id: NodeId | None = None

    def __post_init__(self) -> None:
        _check_request(self.request_id, self.deadline)
        _check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)

    def to_json(self) -> bytes:
        return _encode({**_request_out(self), "prefill_node_id": self.prefill_node_id})

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeGenerateRequest:
        d = _decode(data, cls.__name__)
        return cls(
            **_request_in(d),
            prefill_node_id=_opt_node(d, "prefill_node_id"),
        )


def _request_out(msg: NodeGenerateRequest | PrefillRequest) -> dict[str, Any]:
    """The fields every node request carries, in their wire form."""
    return {
        "request_id": msg.request_id,
        "prompt_token_ids": list(msg.prompt_token_ids),
        "sampling": msg.sampling.to_dict(),
        "cache_salt": msg.cache_salt,
        "deadline": msg.deadline,
    }


def _request_in(d: dict[str, Any]) -> dict[str, Any]:
    """The fields every node request carries, decoded and type-checked (constructor keywords)."""
    return {
        "request_id": RequestId(_field(d, "request_id", str)),
        "prompt_token_ids": _int_list(d, "prompt_token_ids"),
        "sampling": SamplingParams.from_dict(_field(d, "sampling", dict)),
        "cache_salt": _field(d, "cache_salt", str, optional=True),
        "deadline": float(_field(d, "deadline", (int, float))),
    }


def _opt_node(d: dict[str, Any], key: str) -> NodeId | None:
    value = _field(d, key, str, optional=True)
    return None if value is None else NodeId(value)


@dataclass(frozen=True)
class PrefillRequest:
    """Router -> prefill node: compute the prompt, sample the first token, send the KV to the decode node."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None
    deadline: float
    decode_node_id: NodeId
    decode_transfer_addr: str
    fetch_from_url: str | None = None
    """The internal URL of a node the index says holds `fetch_blocks` leading prompt blocks this prefill node
    lacks: fetch them from it (ExportRequest) before computing; None: compute what is not cached here."""
    fetch_blocks: int = 0

    def __post_init__(self) -> None:
        _check_request(self.request_id, self.deadline)
        _check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)
        if not self.decode_node_id or not self.decode_transfer_addr:
            raise ValueError(
                f"decode_node_id {self.decode_node_id!r} and decode_transfer_addr "
                f"{self.decode_transfer_addr!r} must both be set"
            )
        if self.fetch_blocks < 0 or (self.fetch_blocks > 0) != bool(self.fetch_from_url):
            raise ValueError(
                f"fetch_blocks {self.fetch_blocks} must be > 0 exactly when fetch_from_url is set "
                f"({self.fetch_from_url!r})"
            )

    def to_json(self) -> bytes:
        return _encode(
            {
                **_request_out(self),
                "decode_node_id": self.decode_node_id,
                "decode_transfer_addr": self.decode_transfer_addr,
                "fetch_from_url": self.fetch_from_url,
                "fetch_blocks": self.fetch_blocks,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> PrefillRequest:
        d = _decode(data, cls.__name__)
        return cls(
            **_request_in(d),
            decode_node_id=NodeId(_field(d, "decode_node_id", str)),
            decode_transfer_addr=_field(d, "decode_transfer_addr", str),
            fetch_from_url=_field(d, "fetch_from_url", str, optional=True),
            fetch_blocks=_field(d, "fetch_blocks", int, optional=True) or 0,
        )


@dataclass(frozen=True)
class ExportRequest:
    """Fetching node -> holder: push the longest prefix of `block_hashes` you hold to `fetcher_transfer_addr`
    as KV transfer `transfer_id` (the fetcher's receiver answers its OPEN with the blocks it already has)."""

    transfer_id: RequestId
    block_hashes: tuple[bytes, ...]
    fetcher_transfer_addr: str
    deadline: float

    def __post_init__(self) -> None:
        _check_request(self.transfer_id, self.deadline)
        if not self.block_hashes or any(len(h) != 32 for h in self.block_hashes):
            raise ValueError("block_hashes must be a non-empty list of 32-byte hashes")
        if not self.fetcher_transfer_addr:
            raise ValueError("fetcher_transfer_addr is empty")

    def to_json(self) -> bytes:
        return _encode(
            {
                "transfer_id": self.transfer_id,
                "block_hashes": [h.hex() for h in self.block_hashes],
                "fetcher_transfer_addr": self.fetcher_transfer_addr,
                "deadline": self.deadline,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> ExportRequest:
        d = _decode(data, cls.__name__)
        hashes = _field(d, "block_hashes", list)
        if not all(isinstance(h, str) for h in hashes):
            raise ValueError("ExportRequest: block_hashes must be hex strings")
        return cls(
            transfer_id=RequestId(_field(d, "transfer_id", str)),
            block_hashes=tuple(bytes.fromhex(h) for h in hashes),
            fetcher_transfer_addr=_field(d, "fetcher_transfer_addr", str),
            deadline=float(_field(d, "deadline", (int, float))),
        )


@dataclass(frozen=True)
class ExportResult:
    """Holder -> fetching node: `held_blocks` leading blocks were still here (fewer than asked: the index
    was stale), `sent_blocks` of them went out (the fetcher had the others). error None: it completed."""

    held_blocks: int
    sent_blocks: int
    error: str | None = None

    def to_json(self) -> bytes:
        return _encode(
            {"held_blocks": self.held_blocks, "sent_blocks": self.sent_blocks, "error": self.error}
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> ExportResult:
        d = _decode(data, cls.__name__)
        return cls(
            held_blocks=_field(d, "held_blocks", int),
            sent_blocks=_field(d, "sent_blocks", int),
            error=_field(d, "error", str, optional=True),
        )


@dataclass(frozen=True)
class PrefillResult:
    """Prefill node -> router. error None: the KV reached the decode node. Counts: tokens, blocks."""

    request_id: RequestId
    first_token: int | None
    computed_tokens: int
    cached_tokens: int
    transferred_blocks: int
    error: str | None = None
    fetched_tokens: int = 0
    """Of cached_tokens, those fetched from another node for this request (the router's "remote" hits)."""

    def __post_init__(self) -> None:
        if self.error is None and self.first_token is None:
            raise ValueError("a successful PrefillResult needs first_token")
        for name in ("computed_tokens", "cached_tokens", "transferred_blocks", "fetched_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is negative: {getattr(self, name)}")

    def to_json(self) -> bytes:
        return _encode(
            {
                "request_id": self.request_id,
                "first_token": self.first_token,
                "computed_tokens": self.computed_tokens,
                "cached_tokens": self.cached_tokens,
                "transferred_blocks": self.transferred_blocks,
                "error": self.error,
                "fetched_tokens": self.fetched_tokens,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> PrefillResult:
        d = _decode(data, cls.__name__)
        return cls(
            request_id=RequestId(_field(d, "request_id", str)),
            first_token=_field(d, "first_token", int, optional=True),
            computed_tokens=_field(d, "computed_tokens", int),
            cached_tokens=_field(d, "cached_tokens", int),
            transferred_blocks=_field(d, "transferred_blocks", int),
            error=_field(d, "error", str, optional=True),
            fetched_tokens=_field(d, "fetched_tokens", int, optional=True) or 0,
        )


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position. bytes: the token's UTF-8 bytes, or None."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] | None

    def to_wire(self) -> list[Any]:
        return [self.token, self.token_id, _clamp(self.logprob), _bytes_out(self.bytes)]

    @classmethod
    def from_wire(cls, item: Any) -> TopLogprob:
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"top logprob entry must be [token, id, logprob, bytes], got {item!r}")
        entry = dict(zip(("token", "token_id", "logprob", "bytes"), item, strict=True))
        return cls(
            token=_field(entry, "token", str),
            token_id=_field(entry, "token_id", int),
            logprob=float(_field(entry, "logprob", (int, float))),
            bytes=_bytes_in(entry),
        )


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position, its logprob, and the top-N alternatives (N = sampling.logprobs)."""

    token_id: int
    token: str
    logprob: float
    bytes: tuple[int, ...] | None
    top: tuple[TopLogprob, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "logprob": _clamp(self.logprob),
            "bytes": _bytes_out(self.bytes),
            "top": [t.to_wire() for t in self.top],
        }

    @classmethod
    def from_wire(cls, d: Any) -> TokenLogprob:
        if not isinstance(d, dict):
            raise ValueError(f"token logprob must be an object, got {d!r}")
        return cls(
            token_id=_field(d, "token_id", int),
            token=_field(d, "token", str),
            logprob=float(_field(d, "logprob", (int, float))),
            bytes=_bytes_in(d),
            top=tuple(TopLogprob.from_wire(t) for t in _field(d, "top", list)),
        )


def _clamp(logprob: float) -> float:
    if math.isnan(logprob):
        raise ValueError("logprob is NaN")
    return max(logprob, LOGPROB_FLOOR)


def _bytes_out(value: tuple[int, ...] | None) -> list[int] | None:
    return None if value is None else list(value)


def _bytes_in(d: dict[str, Any]) -> tuple[int, ...] | None:
    if d.get("bytes") is None:
        return None
    values = _int_list(d, "bytes")
    if any(not 0 <= b < 256 for b in values):
        raise ValueError(f"bytes out of range 0..255: {values!r}")
    return values


@dataclass(frozen=True)
class StepOutput:
    """Node -> router, one NDJSON line per engine step. Counts are cumulative for the request."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} new tokens")
        if self.error is not None and self.finish_reason not in ("abort", "error"):
            raise ValueError(f"error set but finish_reason is {self.finish_reason!r}")
        _check_token_ids("token_ids", self.token_ids, allow_empty=True)

    def to_line(self) -> bytes:
        return (
            _encode(
                {
                    "request_id": self.request_id,
                    "token_ids": list(self.token_ids),
                    "text": self.text,
                    "logprobs": None if self.logprobs is None else [lp.to_wire() for lp in self.logprobs],
                    "finish_reason": self.finish_reason,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "cached_tokens": self.cached_tokens,
                    "error": self.error,
                }
            )
            + b"\n"
        )

    @classmethod
    def from_line(cls, data: bytes | str) -> StepOutput:
        d = _decode(data, cls.__name__)
        raw_logprobs = _field(d, "logprobs", list, optional=True)
        return cls(
            request_id=RequestId(_field(d, "request_id", str)),
            token_ids=_int_list(d, "token_ids"),
            text=_field(d, "text", str),
            logprobs=None if raw_logprobs is None else tuple(TokenLogprob.from_wire(x) for x in raw_logprobs),
            finish_reason=cast(FinishReason | None, _field(d, "finish_reason", str, optional=True)),
            prompt_tokens=_field(d, "prompt_tokens", int),
            completion_tokens=_field(d, "completion_tokens", int),
            cached_tokens=_field(d, "cached_tokens", int),
            error=_field(d, "error", str, optional=True),
        )


@dataclass(frozen=True)
class AbortRequest:
    """Router -> any node the request touched: stop it and free everything it holds. Idempotent."""

    request_id: RequestId

    def to_json(self) -> bytes:
        return _encode({"request_id": self.request_id})

    @classmethod
    def from_json(cls, data: bytes | str) -> AbortRequest:
        return cls(request_id=RequestId(_field(_decode(data, cls.__name__), "request_id", str)))


@dataclass(frozen=True)
class NodeInfoReply:
    """Node -> router: who the node is and the limits the router checks requests against."""

    node_id: NodeId
    role: NodeRole
    model: str
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        if self.role not in NODE_ROLES:
            raise ValueError(f"role {self.role!r} is not one of {NODE_ROLES}")
        if self.max_model_len <= 0 or self.block_size <= 0:
            raise ValueError(
                f"max_model_len {self.max_model_len} and block_size {self.block_size} must be > 0"
            )

    def to_json(self) -> bytes:
        return _encode(
            {
                "node_id": self.node_id,
                "role": self.role,
                "model": self.model,
                "max_model_len": self.max_model_len,
                "block_size": self.block_size,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeInfoReply:
        d = _decode(data, cls.__name__)
        return cls(
            node_id=NodeId(_field(d, "node_id", str)),
            role=cast(NodeRole, _field(d, "role", str)),
            model=_field(d, "model", str),
            max_model_len=_field(d, "max_model_len", int),
            block_size=_field(d, "block_size", int),
        )
