"""The KV-transfer scenarios' parts: two real paged caches' receiver (PagedReceiver), the prefill side's push,
a raw sender built from the bare framing pieces (for misbehaving on purpose), the audit every scenario ends
with, and the pair (receiver, server, sender) most scenarios start from. Run as a script, this module is the
sender process of the cross-process scenarios (sender_process).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, ParamSpec, TypeVar

import pytest
import torch
from pdserve.kernels.reference import ReferenceOps
from pdserve.kvtransfer.common import DTYPES
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    FrameBlocks,
    KVLayout,
    KVReceiverServer,
    KVSender,
    OpenRefused,
    OpenReply,
    PeerIdentity,
    TransferSession,
    TransferStats,
    create_sender,
    create_server,
)
from pdserve.kvtransfer.framing import ByteChannel, FramedConnection
from pdserve.kvtransfer.handshake import client_handshake
from pdserve.kvtransfer.messages import (
    Data,
    Open,
    OpenOk,
)
from pdserve.kvtransfer.tcp import TcpTransport
from pdserve.kvtransfer.transport import Transport, parse_address
from pdserve.shared.types import BlockHash, BlockId, FirstToken, NodeId, RequestId

UCX = importlib.util.find_spec("ucxx") is not None
"""The ucx connector runs over host memory too, but needs the [ucx] extra (`make test-extras`, CI)."""
if UCX:
    from pdserve.kvtransfer.ucx_transport import UcxTransport
needs_ucx = pytest.mark.skipif(not UCX, reason="ucxx not installed: the [ucx] extra (make test-extras)")

T = TypeVar("T")
P = ParamSpec("P")
LAYOUT = KVLayout(num_layers=4, num_kv_heads=3, head_dim=8, block_size=4, dtype="bfloat16")
FINGERPRINT = b"\x11" * 32
TOKEN = "shared-secret-token"


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def coroutine_test(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """A test written as a coroutine, run to its end under `run`'s timeout; pytest still sees the test's own
    parameters (fixtures, parametrize) through functools.wraps."""

    @functools.wraps(test)
    def sync_test(*args: P.args, **kwargs: P.kwargs) -> None:
        run(test(*args, **kwargs))

    return sync_test


def config(kind: str, **overrides: Any) -> ConnectorConfig:
    fields: dict[str, Any] = {"kind": kind, "auth_token": TOKEN, "handshake_timeout_s": 10.0}
    fields.update(overrides)
    return ConnectorConfig(**fields)


def identity(node: str, layout: KVLayout = LAYOUT, fingerprint: bytes = FINGERPRINT) -> PeerIdentity:
    return PeerIdentity(NodeId(node), fingerprint, layout)


def random_cache(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """kv: [L, 2, N, B, Hkv, D]"""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=g).to(DTYPES[layout.dtype])


def block_hashes(n: int, salt: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([salt, i]) * 16) for i in range(n)]


class PagedReceiver:
    """The decode node's TransferHandler over a real paged cache with a free list and held prefix blocks."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.kv = torch.zeros(
            layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
        )
        self.kv = self.kv.to(DTYPES[layout.dtype])
        self.free: list[int] = list(range(num_blocks))
        self.held: dict[bytes, int] = {}  # block hash -> block D already has
        self.reserved: dict[str, list[int]] = {}
        self.completed: dict[str, FirstToken | None] = {}
        self.aborts: list[tuple[str, str]] = []
        self.silent: list[tuple[str, str]] = []
        self.data_calls = 0
        self.ops = ReferenceOps()

    def hold(self, block_hash: bytes) -> int:
        block = self.free.pop()
        self.held[block_hash] = block
        return block

    async def on_open(self, peer: NodeId, req: Open) -> OpenReply:
        hashes, num_blocks, transfer_id = req.block_hashes, req.num_blocks, req.transfer_id
        num_held = 0
        while num_held < len(hashes) and hashes[num_held] in self.held:
            num_held += 1
        need = num_blocks - num_held
        if need > len(self.free):
            raise OpenRefused(f"need {need} blocks, {len(self.free)} free")
        ids = [self.free.pop() for _ in range(need)]
        self.reserved[transfer_id] = ids
        return OpenReply(num_held, tuple(BlockId(b) for b in ids))

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        self.data_calls += 1
        for i in range(buffer.shape[0]):
            self.ops.scatter_blocks(buffer[i], self.kv[layer_start + i], dst_block_ids)

    async def on_complete(self, transfer_id: RequestId, first_token: FirstToken | None) -> None:
        self.completed[transfer_id] = first_token

    async def on_abort(self, transfer_id: RequestId, reason: str) -> None:
        self.aborts.append((transfer_id, reason))
        self.free.extend(self.reserved.pop(transfer_id))

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        self.silent.append((peer, reason))


async def push(
    session: TransferSession,
    src_kv: torch.Tensor,
    src_blocks: list[int],
    hashes: list[BlockHash],
    layers_per_frame: int = 1,
    first_token: FirstToken | None = None,
) -> tuple[OpenReply, TransferStats]:
    """What the prefill node does: open, gather each layer chunk with the reference op, send, complete."""
    layout_layers = src_kv.shape[0]
    reply = await session.open(hashes, len(src_blocks), time.time() + 30)
    todo = list(range(reply.num_held_blocks, reply.num_blocks))
    blocks = FrameBlocks.run(reply, reply.num_held_blocks, [BlockId(src_blocks[i]) for i in todo])
    src_ids = torch.tensor([src_blocks[i] for i in todo], dtype=torch.int64)
    ops = ReferenceOps()
    for start in range(0, layout_layers, layers_per_frame):
        stop = min(start + layers_per_frame, layout_layers)
        # buffer: [layers, 2, n, B, Hkv, D]
        buffer = torch.empty((stop - start, 2, len(todo), *src_kv.shape[3:]), dtype=src_kv.dtype)
        for layer in range(start, stop):
            ops.gather_blocks(src_kv[layer], src_ids, buffer[layer - start])
        await session.send_layers(start, blocks, buffer)
    stats = await session.complete(first_token or FirstToken(7, -0.25))
    return reply, stats


KINDS = ["tcp", pytest.param("ucx", marks=[pytest.mark.extras, needs_ucx])]
TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "tcp": TcpTransport,
    "ucx": lambda: UcxTransport(config("ucx")),
}


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def started(kind: str, handler: PagedReceiver, **cfg: Any) -> KVReceiverServer:
    server = create_server(config(kind, **cfg), identity("decode-0"), handler)
    await server.start()
    return server


async def raw_sender(kind: str, server: KVReceiverServer) -> FramedConnection:
    """A sender made of the bare framing pieces, for misbehaving on purpose."""
    host, port = parse_address(server.address, kind)
    channel: ByteChannel = await TRANSPORTS[kind]().dial(host, port, 5.0)
    conn = FramedConnection(channel, 1 << 30)
    await client_handshake(
        conn,
        config(kind, checksum=True, liveness_s=60.0),
        identity("raw-prefill"),
    )
    return conn


def data_frame(tid: str, reply: OpenOk, seed: int = 0) -> tuple[Data, torch.Tensor]:
    n = len(reply.dst_block_ids)
    payload = random_cache(LAYOUT, n, seed)[:1]  # [1, 2, n, B, Hkv, D]
    indices = tuple(range(reply.num_held_blocks, reply.num_held_blocks + n))
    return Data(tid, 0, 1, indices, indices, reply.dst_block_ids), payload


def audit(receiver: PagedReceiver, server: KVReceiverServer, num_blocks: int) -> None:
    """Everything reserved was either completed or freed; nothing is left registered on the server."""
    assert server.open_transfer_ids() == frozenset()
    in_use = sum(len(receiver.reserved[t]) for t in receiver.completed)
    assert len(receiver.free) + len(receiver.held) + in_use == num_blocks
    assert set(receiver.reserved) == set(receiver.completed)


class Pair(NamedTuple):
    receiver: PagedReceiver
    server: KVReceiverServer
    sender: KVSender


@asynccontextmanager
async def pair(
    kind: str,
    num_blocks: int,
    sender_identity: PeerIdentity | None = None,
    sender_config: dict[str, Any] | None = None,
    **server_config: Any,
) -> AsyncIterator[Pair]:
    """The set-up most scenarios start from: D's paged receiver of num_blocks blocks behind a started server
    (server_config overrides its ConnectorConfig), and P's sender ("prefill-0" unless sender_identity says,
    sender_config overrides its ConnectorConfig); the sender is closed and the server stopped on every
    path."""
    receiver = PagedReceiver(LAYOUT, num_blocks)
    server = await started(kind, receiver, **server_config)
    try:
        sender = create_sender(
            config(kind, **(sender_config or {})), sender_identity or identity("prefill-0")
        )
        try:
            yield Pair(receiver, server, sender)
        finally:
            await sender.close()
    finally:
        await server.stop()


XPROC_BLOCKS = [3, 8, 1, 10, 6]  # the sender process's source blocks for transfer "xproc"


async def sender_process(kind: str, address: str, mode: str) -> None:
    """The prefill side in its own process: `full` pushes everything, `hang` stops after one layer."""
    src = random_cache(LAYOUT, 12, seed=3)
    sender = create_sender(config(kind), identity("prefill-proc"))
    session = await sender.session(address, RequestId("xproc"))
    if mode == "full":
        _, stats = await push(session, src, XPROC_BLOCKS, block_hashes(4, salt=9), layers_per_frame=2)
        print(f"done {stats.payload_bytes} B in {stats.seconds:.4f} s", flush=True)
        await sender.close()
        return
    reply = await session.open(block_hashes(4, salt=9), len(XPROC_BLOCKS), time.time() + 60)
    blocks = FrameBlocks.run(reply, 0, [BlockId(b) for b in XPROC_BLOCKS])
    buffer = torch.empty((2, len(XPROC_BLOCKS), *src.shape[3:]), dtype=src.dtype)  # [2, n, B, Hkv, D]
    ReferenceOps().gather_blocks(src[0], torch.tensor(XPROC_BLOCKS), buffer)
    await session.send_layers(0, blocks, buffer)
    print("sent", flush=True)
    await asyncio.sleep(3600)  # killed by the test


async def spawn_sender(kind: str, address: str, mode: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, __file__, kind, address, mode, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )


@asynccontextmanager
async def hung_sender(
    kind: str, **server_config: Any
) -> AsyncIterator[tuple[PagedReceiver, KVReceiverServer, asyncio.subprocess.Process]]:
    """D's receiver of 16 blocks behind a started server, and P's process (sender_process `hang`) once D has
    taken the first layer of its transfer "xproc"; the process is killed and the server stopped on every
    path."""
    receiver = PagedReceiver(LAYOUT, num_blocks=16)
    server = await started(kind, receiver, **server_config)
    proc = await spawn_sender(kind, server.address, "hang")
    try:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"sent\n"
        await until(lambda: receiver.data_calls == 1)
        yield receiver, server, proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await server.stop()


if __name__ == "__main__":
    asyncio.run(sender_process(*sys.argv[1:4]))
