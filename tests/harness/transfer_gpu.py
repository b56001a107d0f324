"""The GPU transfer scenarios' parts (cuda_ipc and ucx on a GPU): D's paged cache on a GPU, P's seeded source
cache and the blocks each numbered transfer sends from it, P's push with its buffers on its GPU, P's process
spawned from a test module's script (and its hang until killed), and the checks and audits at its end."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

import torch
from pdserve.kernels.reference import ReferenceOps
from pdserve.kvtransfer.connector import (
    ConnectorOptions,
    FrameBlocks,
    KVReceiverServer,
    KVSender,
    TransferSession,
)
from pdserve.shared.types import BlockHash, BlockId, FirstToken, RequestId
from pdserve.tests.harness.transfer import (
    LAYOUT,
    PagedReceiver,
    audit,
    block_hashes,
    random_cache,
    started,
    until,
)

BLOCKS = 48  # D's GPU cache: 12 transfers of 4 blocks each, which completed requests keep
SOURCE_BLOCKS = 12  # P's cache


def source_cache(device: str) -> torch.Tensor:
    """P's seeded cache of SOURCE_BLOCKS blocks on `device` (on the CPU, what D must hold once it landed)."""
    return random_cache(LAYOUT, SOURCE_BLOCKS, seed=5).to(device)


def source_blocks(t: int) -> list[int]:
    """The 4 blocks of P's cache that transfer `t` sends: not one run, and a different set for each t."""
    return [(t + 3 * i) % SOURCE_BLOCKS for i in range(4)]


def devices() -> tuple[str, str]:
    """(D's device, P's device)."""
    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


async def push_on_gpu(
    session: TransferSession,
    src: torch.Tensor,
    blocks: list[int],
    hashes: list[BlockHash],
    layers: int | None,
) -> None:
    """`push` of the protocol suite with the buffers on the cache's GPU: frames of 3 layers, each complete
    (synchronized) before it is sent, as the connector requires; `layers`: stop after that many layers,
    without completing."""
    reply = await session.open(hashes, len(blocks), time.time() + 30)
    todo = list(range(reply.num_held_blocks, reply.num_blocks))
    frame_blocks = FrameBlocks.run(reply, reply.num_held_blocks, [BlockId(blocks[i]) for i in todo])
    ids = torch.tensor([blocks[i] for i in todo], dtype=torch.int64, device=src.device)
    ops = ReferenceOps()
    for start in range(0, layers or LAYOUT.num_layers, 3):
        stop = min(start + 3, layers or LAYOUT.num_layers)
        buffer = torch.empty((stop - start, 2, len(todo), *src.shape[3:]), dtype=src.dtype, device=src.device)
        for layer in range(start, stop):
            ops.gather_blocks(src[layer], ids, buffer[layer - start])
        torch.cuda.synchronize(src.device)
        await session.send_layers(start, frame_blocks, buffer)
    if layers is None:
        await session.complete(FirstToken(7, -0.25))


async def push_numbered(
    sender: KVSender, address: str, src: torch.Tensor, prefix: str, t: int, whole: bool
) -> TransferSession:
    """Transfer `prefix-t` of `source_blocks(t)` from `src` to D at `address`; `whole=False`: its first
    frame (one layer) only, not completed."""
    session = await sender.session(address, RequestId(f"{prefix}-{t}"))
    await push_on_gpu(session, src, source_blocks(t), block_hashes(3, salt=t), layers=None if whole else 1)
    return session


async def hang() -> None:
    """P's side of `kill_at_first_frame`: says that it sent its frame, then waits to be killed."""
    print("sent", flush=True)
    await asyncio.sleep(60)


def check_landed(receiver: GpuReceiver, prefix: str, count: int) -> None:
    """Transfers `prefix-0` to `prefix-(count-1)` landed in D's cache bit for bit."""
    src = source_cache("cpu")
    for t in range(count):
        dst = receiver.reserved[f"{prefix}-{t}"]
        for j, s in enumerate(source_blocks(t)):
            assert torch.equal(receiver.kv[:, :, dst[j]].cpu(), src[:, :, s]), (t, j)


class GpuReceiver(PagedReceiver):
    def __init__(self, device: str) -> None:
        super().__init__(LAYOUT, num_blocks=BLOCKS)
        self.kv = self.kv.to(device)


async def spawn(script: str, address: str, mode: str, device: str) -> asyncio.subprocess.Process:
    """P: `script` (a test module's path) run as `script address mode device` (its `_sender_process`)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, script, address, mode, device, stdout=asyncio.subprocess.PIPE
    )


async def kill_at_first_frame(proc: asyncio.subprocess.Process, receiver: PagedReceiver) -> None:
    """Kill P once it said it sent its first frame and D handled that frame."""
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"sent\n"
    await until(lambda: receiver.data_calls == 1)
    proc.kill()


async def aborted_once(receiver: PagedReceiver, server: KVReceiverServer, transfer_id: str) -> None:
    """D aborted that transfer, and only once, and every block is accounted for."""
    await until(lambda: receiver.aborts)
    await asyncio.sleep(0.3)
    assert [t for t, _ in receiver.aborts] == [transfer_id]
    audit(receiver, server, BLOCKS)


@contextlib.asynccontextmanager
async def serving(
    kind: str, options: ConnectorOptions
) -> AsyncIterator[tuple[GpuReceiver, KVReceiverServer, str]]:
    """D's server of that kind on the first GPU; yields (receiver, server, P's device); stopped on every
    path."""
    d_device, p_device = devices()
    receiver = GpuReceiver(d_device)
    server = await started(kind, receiver, device=d_device, options=options)
    try:
        yield receiver, server, p_device
    finally:
        await server.stop()
