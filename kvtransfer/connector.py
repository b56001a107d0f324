"""The KV-transfer interface the nodes program against, and the registry that picks a connector by name.

P pushes KV into D's blocks (docs/kv_transfer_protocol.md): D runs one `KVReceiverServer` per node and
implements `TransferHandler`; P holds one `KVSender` per node, which caches one connection per peer and
multiplexes `TransferSession`s on it by transfer id. Nodes call `create_sender` / `create_server` with a
`ConnectorConfig`; the kind string selects the implementation through the registry, so node code never
branches on the backend. Invariant: for every OPEN that D accepted, exactly one of on_complete (then ACK) or
on_abort is called, on every path (P abort, deadline, connection cut, bad frame, server stop).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from pdserve.kvtransfer.common import (
    ChecksumError,
    ConnectionLost,
    FrameBlocks,
    HandshakeError,
    KVLayout,
    KVTransferError,
    OpenRefused,
    OpenReply,
    PeerIdentity,
    ProtocolError,
    TransferAborted,
    TransferRefused,
    TransferStats,
)
from pdserve.kvtransfer.messages import Open
from pdserve.shared import checks
from pdserve.shared.types import BlockHash, FirstToken, NodeId, RequestId

_O = TypeVar("_O", bound="ConnectorOptions")

__all__ = [
    "ChecksumError",
    "ConnectionLost",
    "Connector",
    "ConnectorConfig",
    "ConnectorOptions",
    "FrameBlocks",
    "HandshakeError",
    "KVLayout",
    "KVReceiverServer",
    "KVSender",
    "KVTransferError",
    "Open",
    "OpenRefused",
    "OpenReply",
    "PeerIdentity",
    "ProtocolError",
    "TransferAborted",
    "TransferHandler",
    "TransferRefused",
    "TransferSession",
    "TransferStats",
    "connector_kinds",
    "create_sender",
    "create_server",
    "register_connector",
]


class TransferHandler(Protocol):
    """D's side, implemented by the decode node. Calls for one transfer never overlap."""

    async def on_open(self, peer: NodeId, req: Open) -> OpenReply:
        """`peer` opens `req`: match the held prefix, reserve the rest; raise `OpenRefused(reason)` to
        refuse."""

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        """dst_block_ids: [n] int64; buffer: [num_layers, 2, n, B, Hkv, D] in the layout's dtype, on
        `ConnectorConfig.device`, valid only during the call (e.g. `ops.scatter_blocks(buffer[i],
        kv_cache[layer_start + i], dst_block_ids)`); GPU kernels reading it must be queued on the current
        stream by the time the call returns (the connector waits for that stream before reusing it)."""

    async def on_complete(self, transfer_id: RequestId, first_token: FirstToken | None) -> None:
        """Every reserved block has every layer; the request may start decoding (first_token: the token P
        sampled; None for a transfer that carries only KV, a prefix fetch). Raising aborts it."""

    async def on_abort(self, transfer_id: RequestId, reason: str) -> None:
        """Free the reservation. At most once per accepted transfer, never after on_complete returned."""

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        """The connection from `peer` went silent past the liveness window (the peer stopped or hung) and
        was cut; its transfers were aborted first. Transfers `peer` meant to open on it will not come."""


class TransferSession(Protocol):
    """P's side of one transfer (one request) to one D. Used from asyncio."""

    @property
    def transfer_id(self) -> RequestId: ...

    async def open(self, block_hashes: Sequence[BlockHash], num_blocks: int, deadline: float) -> OpenReply:
        """Reserve on D; raises TransferRefused. deadline: unix seconds, the request's one deadline."""

    async def send_layers(self, layer_start: int, blocks: FrameBlocks, buffer: torch.Tensor) -> None:
        """buffer: [num_layers, 2, n, B, Hkv, D] or [2, n, B, Hkv, D] (one layer), from `ops.gather_blocks`,
        block j of it described by column j of `blocks`, in host or device memory (the connector stages it
        through the host if its link needs that). A CUDA buffer must be complete when passed (e.g. wait for an
        event recorded after the gather): GPU connectors send it without ordering after any stream, so a
        layer's transfer never waits for compute queued after its gather. Returns when the frame is handed
        to the transport; a GPU connector may still be sending the buffer then (it keeps it alive), so do
        not write into it again. Raises TransferAborted when D aborted."""

    async def complete(self, first_token: FirstToken | None) -> TransferStats:
        """Send COMPLETE (with the first token P sampled, or None when the transfer carries only KV) and
        return when D acknowledged it."""

    async def abort(self, reason: str) -> None:
        """Tell D to free the reservation; idempotent, a no-op after complete()."""


class KVSender(Protocol):
    """P's per-node client; connections are opened on first use per peer address and reused."""

    async def session(self, peer_address: str, transfer_id: RequestId) -> TransferSession:
        """Connect (handshake once per peer, raises HandshakeError) and start a session."""

    async def close(self) -> None:
        """Abort open sessions and close every connection."""


class KVReceiverServer(Protocol):
    @property
    def address(self) -> str:
        """`<kind>://<host>:<port>`, valid after start()."""

    def open_transfer_ids(self) -> frozenset[RequestId]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Close the listener and every connection; open transfers are aborted (on_abort called)."""


class ConnectorOptions:
    """Base of a connector's own settings: a frozen dataclass in the connector's module (ucx.UcxOptions,
    cuda_ipc.CudaIpcOptions), named by its `Connector.options`, so adding a connector never edits this one."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Transfer settings of one node. Both ends need the same `auth_token`; it never goes on the wire."""

    kind: str
    auth_token: str
    # CRC32 every frame; a connection checksums if either end asks for it. None: the connector's default
    # (on for tcp and for ucx over host memory; off for nccl and for ucx on a GPU, whose NVLink/RDMA links
    # check integrity themselves, and where a CRC would copy every payload to the host).
    checksum: bool | None = None
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port, see KVReceiverServer.address
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0  # covers the payload plane's setup (nccl's communicator) too
    ack_grace_s: float = 2.0  # P waits for ACK until the request deadline plus this
    max_payload_bytes: int = 1 << 30
    # Where received payloads land ("cpu" or "cuda:N"; the node's KV-cache device) and, for nccl, the
    # GPU of this end's communicator. Sent payloads are read from wherever the caller's buffer lives.
    device: str = "cpu"
    # Liveness: each end sends a PING whenever it sent nothing for a quarter of the stricter end's window;
    # D cuts a sender from which no byte arrived for this long (stopped, hung, or its link dead), as either
    # end does a payload op on a GPU link still in flight after it; the connection's transfers abort at once
    # (D then computes their prompts itself, or fails them: the decode node's kv_load_failure_policy). It
    # must exceed the longest one frame takes on the link (tcp: `max_payload_bytes` over its bandwidth).
    liveness_s: float = 5.0
    # The connector's own settings, of its `Connector.options` type (None: its defaults; a connector whose
    # `options` is None has none).
    options: ConnectorOptions | None = None

    def __post_init__(self) -> None:
        if self.kind not in _REGISTRY:
            raise ValueError(f"unknown connector kind {self.kind!r}; registered: {connector_kinds()}")
        if not self.auth_token:
            raise ValueError("ConnectorConfig.auth_token must be a non-empty shared secret")
        checks.port(self, "listen_port")
        checks.above(self, 0, "connect_timeout_s", "handshake_timeout_s", "ack_grace_s", "liveness_s",
                     "max_payload_bytes")  # fmt: skip
        # only a config that carries options imports its connector's module (a light one, never its library)
        expected = _connector(self.kind).options if self.options is not None else None
        if self.options is not None and type(self.options) is not expected:
            wants = "none" if expected is None else expected.__name__
            raise ValueError(
                f"ConnectorConfig.options {type(self.options).__name__} do not fit kind {self.kind!r} "
                f"(it takes {wants})"
            )
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"ConnectorConfig.device {self.device!r} is not a torch device") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ConnectorConfig.device {self.device!r} must be 'cpu' or 'cuda:N'")

    def options_of(self, kind: type[_O]) -> _O:
        """The connector's own settings as `kind` (its defaults when `options` is None)."""
        options = self.options if self.options is not None else kind()
        assert type(options) is kind, f"{self.kind} options are {type(options).__name__}, not {kind.__name__}"
        return options

    @property
    def frame_checksum(self) -> bool:
        """Whether this end asks for checksummed frames (the `checksum` field, or the connector's default)."""
        if self.checksum is not None:
            return self.checksum
        return _connector(self.kind).default_checksum(self)


class Connector(Protocol):
    """One registered implementation: builds the two ends. Its module is imported to read a config's
    options or checksum default, so it imports an optional library only when it builds an end."""

    @property
    def options(self) -> type[ConnectorOptions] | None:
        """The type of the connector's own settings (`ConnectorConfig.options`); None: it has none."""

    def default_checksum(self, config: ConnectorConfig) -> bool:
        """Whether frames are checksummed when `config.checksum` leaves it open."""

    def make_sender(self, config: ConnectorConfig, identity: PeerIdentity) -> KVSender: ...

    def make_server(
        self, config: ConnectorConfig, identity: PeerIdentity, handler: TransferHandler
    ) -> KVReceiverServer: ...


# kind -> a Connector, or "module:attribute" of one, imported on first use
_REGISTRY: dict[str, Connector | str] = {
    "tcp": "pdserve.kvtransfer.tcp:CONNECTOR",
    "ucx": "pdserve.kvtransfer.ucx:CONNECTOR",
    "nccl": "pdserve.kvtransfer.nccl:CONNECTOR",
    "cuda_ipc": "pdserve.kvtransfer.cuda_ipc:CONNECTOR",
}


def register_connector(kind: str, connector: Connector | str) -> None:
    if kind in _REGISTRY:
        raise ValueError(f"connector kind {kind!r} is already registered")
    _REGISTRY[kind] = connector


def connector_kinds() -> list[str]:
    return sorted(_REGISTRY)


def _connector(kind: str) -> Connector:
    entry = _REGISTRY[kind]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _REGISTRY[kind] = entry
    return entry


def create_sender(config: ConnectorConfig, identity: PeerIdentity) -> KVSender:
    return _connector(config.kind).make_sender(config, identity)


def create_server(
    config: ConnectorConfig, identity: PeerIdentity, handler: TransferHandler
) -> KVReceiverServer:
    return _connector(config.kind).make_server(config, identity, handler)
