"""Per-frame fast paths of the KV-transfer protocol: pipelined payload sends, frames naming scattered blocks,
and the sender's one deadline timer per session.

Pipelining runs over the pair-group transport with gloo standing in for NCCL (tests/harness/gloo_pair.py; see
test_kvtransfer_pair_group.py for what that does and does not show); the rest over real TCP sockets.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from pdserve.kvtransfer.connector import FrameBlocks, KVLayout, OpenReply, TransferAborted, create_sender
from pdserve.kvtransfer.pair_group import MAX_IN_FLIGHT, live_groups, wait_aborted
from pdserve.kvtransfer.sender import ChannelSession
from pdserve.shared.types import BlockId, FirstToken, RequestId
from pdserve.tests.harness import transfer
from pdserve.tests.harness.gloo_pair import KIND


class HeldReceiver(transfer.PagedReceiver):
    """Holds its first on_data until released, so D posts no further payload receive meanwhile."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        self.release = asyncio.Event()

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        await self.release.wait()
        await super().on_data(transfer_id, layer_start, dst_block_ids, buffer)


@transfer.coroutine_test
async def test_payload_sends_are_pipelined_and_land_in_order() -> None:
    """P's send_layers returns once a payload is posted: while D is stuck in its first on_data, P still
    hands over more frames; released, D gets every layer bit for bit, and nothing is left in flight."""
    layers = transfer.LAYOUT.num_layers
    assert layers <= MAX_IN_FLIGHT
    receiver = HeldReceiver(transfer.LAYOUT, 8)
    server = await transfer.started(KIND, receiver)
    sender = create_sender(transfer.config(KIND), transfer.identity("prefill-0"))
    src = transfer.random_cache(transfer.LAYOUT, 6, seed=9)
    try:
        session = await sender.session(server.address, RequestId("piped"))
        assert isinstance(session, ChannelSession)
        push = asyncio.ensure_future(transfer.push(session, src, [5, 2, 0], []))
        await transfer.until(lambda: receiver.data_calls == 0 and len(server._connections) == 1)  # type: ignore[attr-defined]
        await asyncio.sleep(0.5)
        assert not push.done(), "COMPLETE was acknowledged while D held the first frame"
        assert session._payload_bytes == layers * 3 * transfer.LAYOUT.layer_block_bytes, "P waited"
        receiver.release.set()
        reply, stats = await push
        for j, b in enumerate(reply.dst_block_ids):
            assert torch.equal(receiver.kv[:, :, b], src[:, :, [5, 2, 0][j]])
        assert receiver.data_calls == layers and stats.payload_bytes == session._payload_bytes
        transfer.audit(receiver, server, 8)
    finally:
        await sender.close()
        await server.stop()
    await asyncio.to_thread(wait_aborted, 5.0)
    assert live_groups() == 0


@transfer.coroutine_test
async def test_frames_naming_scattered_blocks_land_where_they_say() -> None:
    """Frames whose blocks are not one consecutive run take the per-block path and still land exactly."""
    async with transfer.pair("tcp", 8) as (receiver, server, sender):
        src = transfer.random_cache(transfer.LAYOUT, 4, seed=3)
        session = await sender.session(server.address, RequestId("scattered"))
        reply = await session.open([], 4, time.time() + 30)
        dst = reply.dst_block_ids
        for layer in range(transfer.LAYOUT.num_layers):
            for order in ([3, 0], [2, 1]):
                ids = tuple(BlockId(i) for i in order)
                blocks = FrameBlocks(tuple(order), ids, tuple(dst[i] for i in order))
                # buf: [2, n, B, Hkv, D]
                await session.send_layers(layer, blocks, src[layer][:, order].contiguous())
        with pytest.raises(ValueError, match="is not in the reservation"):  # P checks first
            await session.send_layers(0, FrameBlocks((0,), (BlockId(0),), (dst[1],)), src[0][:, :1])
        await session.complete(FirstToken(1))
        for i, b in enumerate(dst):
            assert torch.equal(receiver.kv[:, :, b], src[:, :, i])
        transfer.audit(receiver, server, 8)


@transfer.coroutine_test
async def test_send_after_the_deadline_is_refused_and_d_frees_the_blocks() -> None:
    async with transfer.pair("tcp", 4) as (receiver, server, sender):
        src = transfer.random_cache(transfer.LAYOUT, 1, seed=5)
        session = await sender.session(server.address, RequestId("late"))
        reply = await session.open([], 1, time.time() + 0.3)
        await asyncio.sleep(0.5)
        with pytest.raises(TransferAborted, match="deadline"):
            await session.send_layers(0, FrameBlocks.run(reply, 0, [BlockId(0)]), src[0])
        await transfer.until(lambda: receiver.aborts)
        assert receiver.aborts[0][0] == "late" and "deadline" in receiver.aborts[0][1]
        transfer.audit(receiver, server, 4)


def test_frame_blocks_columns_and_runs() -> None:
    """A frame names its blocks as three equal columns; `run` takes D's reserved ids for consecutive blocks
    past the held prefix and refuses blocks the reservation does not cover."""
    reply = OpenReply(2, (BlockId(7), BlockId(3), BlockId(9)))  # D holds blocks 0-1; 2, 3, 4 go to 7, 3, 9
    blocks = FrameBlocks.run(reply, 3, [BlockId(40), BlockId(41)])
    assert blocks == FrameBlocks((3, 4), (BlockId(40), BlockId(41)), (BlockId(3), BlockId(9)))
    assert len(blocks) == 2
    with pytest.raises(ValueError, match="not all reserved"):
        FrameBlocks.run(reply, 1, [BlockId(1), BlockId(2)])  # block 1 is held by D
    with pytest.raises(ValueError, match="not all reserved"):
        FrameBlocks.run(reply, 4, [BlockId(1), BlockId(2)])  # block 5 is past the prompt
    with pytest.raises(ValueError, match="differ in length"):
        FrameBlocks((0, 1), (BlockId(0),), (BlockId(7), BlockId(3)))
