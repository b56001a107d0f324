"""Payload-first DATA frames and bounded payloads (`ByteChannel.payload_limit`: cuda_ipc), on the CPU.

Without checksums a DATA frame's payload leaves before its header (framing.py). A TCP channel that also
declares a frame limit and records what it sends stands in for cuda_ipc's window: the session must split
buffers larger than the limit into layer groups that fit, every payload must go out before its header, and
a frame whose header cannot be built must reach D as a payload that D drops, with the session going on.
A payload-first frame that is not followed by its header is a protocol error that ends the connection.
"""

from __future__ import annotations

import time

import pytest
import torch
from pdserve.kernels.reference import ReferenceOps
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.connector import (
    FrameBlocks,
    connector_kinds,
    register_connector,
)
from pdserve.kvtransfer.framing import FLAG_HEADER_AFTER, FLAG_PAYLOAD_FIRST, PREFIX, ByteChannel
from pdserve.kvtransfer.tcp import TcpChannel, TcpTransport
from pdserve.shared.types import BlockId, FirstToken, RequestId
from pdserve.tests.harness.transfer import (
    LAYOUT,
    audit,
    block_hashes,
    pair,
    push,
    random_cache,
    run,
)

KIND = "tcp-bounded"
LIMIT = 4096  # bytes per frame: one layer of 4 blocks is 1536 B, so 2 layers fit and 3 do not
CHANNELS: list[BoundedTcpChannel] = []


class BoundedTcpChannel(TcpChannel):
    """TCP with a frame limit, recording the frames it sends."""

    payload_limit = LIMIT

    def __init__(self, channel: TcpChannel) -> None:
        super().__init__(channel._stream)
        self.sent: list[tuple[int, int, int]] = []  # (flags, header bytes, payload bytes) per frame
        CHANNELS.append(self)

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        flags = PREFIX.unpack(prefix)[3]
        nbytes = 0 if payload is None else payload.numel()
        assert nbytes <= self.payload_limit, f"{nbytes} B over the frame limit"
        self.sent.append((flags, len(header), nbytes))
        await super().send(prefix, header, payload)

    def payloads(self) -> list[int]:
        return [n for _, _, n in self.sent if n]

    def dropped(self) -> int:
        return sum(1 for flags, h, _ in self.sent if flags == FLAG_HEADER_AFTER and h == 0)


class BoundedTcpTransport(TcpTransport):
    scheme = KIND

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        channel = await super().dial(host, port, timeout_s)
        assert isinstance(channel, TcpChannel)
        return BoundedTcpChannel(channel)


UNCHECKED = {"checksum": False}
"""The sender's side of a connection without checksums (the bounded transport's default)."""

if KIND not in connector_kinds():
    register_connector(KIND, ChannelConnector(lambda cfg: BoundedTcpTransport(), checksum_default=False))


def test_buffers_over_the_frame_limit_are_split_into_layer_groups_that_fit() -> None:
    async def scenario() -> None:
        async with pair(KIND, 16, sender_config=UNCHECKED, checksum=False) as (receiver, server, sender):
            src = random_cache(LAYOUT, 12, seed=9)
            blocks = [3, 8, 1, 10]
            session = await sender.session(server.address, RequestId("split"))
            reply, stats = await push(session, src, blocks, block_hashes(3), layers_per_frame=3)
            # 3 layers (4608 B) do not fit: 2 + 1 layers; then the last layer alone
            channel = CHANNELS[-1]
            assert channel.payloads() == [2 * 1536, 1536, 1536]
            data = [(f, h, n) for f, h, n in channel.sent if f & (FLAG_PAYLOAD_FIRST | FLAG_HEADER_AFTER)]
            assert [f for f, _, _ in data] == [FLAG_PAYLOAD_FIRST, FLAG_HEADER_AFTER] * 3
            assert all(h == 0 and n > 0 for f, h, n in data[::2]) and all(
                h > 0 and n == 0 for _, h, n in data[1::2]
            )
            assert receiver.data_calls == 3
            assert stats.payload_bytes == LAYOUT.num_layers * 4 * LAYOUT.layer_block_bytes
            for j, b in enumerate(blocks):
                assert torch.equal(receiver.kv[:, :, reply.dst_block_ids[j]], src[:, :, b])
            audit(receiver, server, 16)

    run(scenario())


def test_a_frame_whose_header_fails_is_dropped_and_the_session_goes_on() -> None:
    async def scenario() -> None:
        async with pair(KIND, 16, sender_config=UNCHECKED, checksum=False) as (receiver, server, sender):
            src = random_cache(LAYOUT, 12, seed=10)
            session = await sender.session(server.address, RequestId("bad-frame"))
            reply = await session.open(block_hashes(1), 2, time.time() + 30)
            buffer = torch.empty((1, 2, 2, *src.shape[3:]), dtype=src.dtype)
            ops = ReferenceOps()
            ops.gather_blocks(src[0], torch.tensor([4, 6]), buffer[0])
            wrong = FrameBlocks((0, 1), (BlockId(4), BlockId(6)), (BlockId(99), BlockId(98)))
            with pytest.raises(ValueError, match="is not in the reservation"):
                await session.send_layers(0, wrong, buffer)
            channel = CHANNELS[-1]
            assert channel.payloads() == [buffer.numel() * buffer.element_size()] and channel.dropped() == 1
            assert receiver.data_calls == 0
            right = FrameBlocks.run(reply, 0, [BlockId(4), BlockId(6)])
            await session.send_layers(0, right, buffer)
            for layer in range(1, LAYOUT.num_layers):
                ops.gather_blocks(src[layer], torch.tensor([4, 6]), buffer[0])
                await session.send_layers(layer, right, buffer.clone())
            await session.complete(FirstToken(1))
            for j, b in enumerate([4, 6]):
                assert torch.equal(receiver.kv[:, :, reply.dst_block_ids[j]], src[:, :, b])
            assert receiver.data_calls == LAYOUT.num_layers and channel.dropped() == 1
            audit(receiver, server, 16)

    run(scenario())
