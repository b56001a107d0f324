"""The ucx connector on a GPU: payloads land in D's device buffer while D checks their headers.

D (a paged cache on the GPU) runs in this process and P as this file's script in a second process, on the
first GPU or, with two, the second one (UCX moves the bytes with cuda_ipc). CI has no GPU and skips these;
it covers the ucx connector over host memory with the protocol suite (tests/harness/transfer_suite.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

import pytest
import torch
from pdserve.kvtransfer.connector import FrameBlocks, create_sender
from pdserve.kvtransfer.ucx import UcxOptions
from pdserve.shared.types import BlockId, FirstToken, RequestId
from pdserve.tests.harness import transfer_gpu
from pdserve.tests.harness.transfer import LAYOUT, audit, block_hashes, config, identity, run, until

pytestmark = pytest.mark.extras  # needs ucxx, the [ucx] extra: `make test-extras`

TRANSFERS = 12  # of 4 blocks each: GpuReceiver's cache holds BLOCKS = 48, and completed requests keep theirs


async def _sender_process(address: str, mode: str, device: str) -> None:
    """P, as a script. full: TRANSFERS transfers of two frames each; drop: one transfer whose first frame's
    header cannot be built (its payload goes, D drops it), then the real frames; hang: one frame, then wait
    to be killed."""
    sender = create_sender(config("ucx", device=device), identity("prefill-0"))
    src = transfer_gpu.source_cache(device)
    try:
        if mode == "drop":
            session = await sender.session(address, RequestId("ucx-0"))
            reply = await session.open(block_hashes(3, salt=0), 4, time.time() + 30)
            assert reply.num_held_blocks == 0
            todo = [BlockId(b) for b in transfer_gpu.source_blocks(0)]
            wrong = FrameBlocks(tuple(range(4)), tuple(todo), tuple(BlockId(10_000 + i) for i in range(4)))
            buffer = torch.zeros((1, 2, 4, *src.shape[3:]), dtype=src.dtype, device=device)
            with contextlib.suppress(ValueError):
                await session.send_layers(0, wrong, buffer)
            print("dropped", flush=True)
            right = FrameBlocks.run(reply, 0, todo)
            for layer in range(LAYOUT.num_layers):
                ids = torch.tensor(transfer_gpu.source_blocks(0), device=device)
                await session.send_layers(layer, right, src[layer][:, ids].unsqueeze(0).contiguous())
            await session.complete(FirstToken(7))
        for t in range(TRANSFERS if mode == "full" else 1 if mode == "hang" else 0):
            await transfer_gpu.push_numbered(sender, address, src, "ucx", t, whole=mode == "full")
            if mode == "hang":
                await transfer_gpu.hang()
    finally:
        await sender.close()
    print(json.dumps({"closed": True}), flush=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="ucx on a GPU needs one")
@pytest.mark.parametrize(("mode", "window_bytes"), [("full", 512 << 20), ("full", 2048), ("drop", 512 << 20)])
def test_ucx_gpu_transfers_are_bit_identical_across_processes(mode: str, window_bytes: int) -> None:
    """With a 2 KiB window, the 3-layer frames (4.5 KiB) take D's LATE receive and the 1-layer frames its
    standing one; with the default window every frame lands through the standing receive."""

    async def scenario() -> None:
        async with transfer_gpu.serving("ucx", UcxOptions(window_bytes=window_bytes)) as (
            receiver,
            server,
            p_device,
        ):
            proc = await transfer_gpu.spawn(__file__, server.address, mode, p_device)
            out, _ = await proc.communicate()
            assert proc.returncode == 0, out
            count = TRANSFERS if mode == "full" else 1
            transfer_gpu.check_landed(receiver, "ucx", count)
            assert len(receiver.completed) == count
            # full: frames of 3 layers and 1 layer; drop: one frame per layer (the dropped one never arrives)
            assert receiver.data_calls == (2 * TRANSFERS if mode == "full" else LAYOUT.num_layers)
            await until(lambda: not server.open_transfer_ids())
            audit(receiver, server, transfer_gpu.BLOCKS)

    run(scenario(), timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="ucx on a GPU needs one")
def test_ucx_gpu_killed_sender_frees_the_reservation_once() -> None:
    async def scenario() -> None:
        async with transfer_gpu.serving("ucx", UcxOptions(window_bytes=512 << 20)) as (
            receiver,
            server,
            p_device,
        ):
            proc = await transfer_gpu.spawn(__file__, server.address, "hang", p_device)
            await transfer_gpu.kill_at_first_frame(proc, receiver)
            await proc.communicate()
            await transfer_gpu.aborted_once(receiver, server, "ucx-0")

    run(scenario(), timeout=120)


if __name__ == "__main__":
    asyncio.run(_sender_process(*sys.argv[1:4]))
