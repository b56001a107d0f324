"""Round trips of every KV-transfer message and frame, and the decoder's refusals of malformed peers."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pdserve.kvtransfer.common import ChecksumError, KVLayout, ProtocolError
from pdserve.kvtransfer.framing import (
    FLAG_HEADER_AFTER,
    FLAG_PAYLOAD_FIRST,
    PREFIX,
    PREFIX_SIZE,
    FramedConnection,
    VersionMismatch,
    encode_frame,
)
from pdserve.kvtransfer.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Data,
    Hello,
    Message,
    Open,
    OpenOk,
    Ready,
    decode_header,
    encode_header,
)
from pdserve.shared.types import BlockHash, RequestId
from pdserve.tests.harness.memory_channel import InMemoryChannel
from pdserve.tests.harness.messages import EXAMPLES, LAYOUT

ids = st.text(min_size=1, max_size=40)
ints = st.lists(st.integers(0, 2**31 - 1), max_size=64).map(tuple)


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_header_round_trip(msg: Message) -> None:
    assert decode_header(msg.TYPE, encode_header(msg)) == msg


@given(tid=ids, start=st.integers(0, 1000), n=st.integers(1, 8), idx=ints, src=ints, dst=ints)
def test_data_round_trip(
    tid: str, start: int, n: int, idx: tuple[int], src: tuple[int], dst: tuple[int]
) -> None:
    msg = Data(tid, start, n, idx, src, dst)
    assert decode_header(Data.TYPE, encode_header(msg)) == msg


@given(tid=ids, hashes=st.lists(st.binary(min_size=32, max_size=32), max_size=20), deadline=st.floats(0, 2e9))
def test_open_round_trip(tid: str, hashes: list[bytes], deadline: float) -> None:
    msg = Open(RequestId(tid), tuple(BlockHash(h) for h in hashes), len(hashes) + 1, deadline)
    assert decode_header(Open.TYPE, encode_header(msg)) == msg


@pytest.mark.parametrize(
    ("msg_type", "body", "named"),
    [
        (
            Open.TYPE,
            {"transfer_id": "r", "block_hashes": ["hex"], "num_blocks": 1, "deadline": 1.0},
            "block_hashes[0]",
        ),
        (Open.TYPE, {"transfer_id": "r", "block_hashes": [], "deadline": 1.0}, "num_blocks"),
        (OpenOk.TYPE, {"transfer_id": "r", "num_held_blocks": True, "dst_block_ids": []}, "num_held_blocks"),
        (Hello.TYPE, {**msgpack.unpackb(encode_header(EXAMPLES[0])), "layout": {"num_layers": 0}}, "layout"),
        (99, {}, "unknown message type 99"),
    ],
)
def test_malformed_headers_are_refused_by_name(msg_type: int, body: dict[str, object], named: str) -> None:
    with pytest.raises(ProtocolError, match=named.replace("[", r"\[").replace("]", r"\]")):
        decode_header(msg_type, msgpack.packb({"v": PROTOCOL_VERSION, **body}))


def test_layout_names_the_first_difference() -> None:
    other = KVLayout(30, 3, 64, 32, "bfloat16", tp_size=2)
    assert LAYOUT.first_difference(other) == (
        "block_size: local 16, peer 32 (local 30 layers x 3 KV heads x 64, block 16, bfloat16 at TP 2; "
        "peer 30 layers x 3 KV heads x 64, block 32, bfloat16 at TP 2)"
    )
    assert LAYOUT.first_difference(LAYOUT) is None
    assert LAYOUT.first_difference(KVLayout(30, 3, 64, 16, "bfloat16", tp_size=3)) is None  # any TP pair
    with pytest.raises(ValueError, match="dtype 'int8'"):
        KVLayout(1, 1, 1, 1, "int8")


class MemoryChannel(InMemoryChannel):
    """Frame parts in a queue: enough of a ByteChannel to test the framing codec without a transport."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        # an empty header is no part: framing never reads 0 bytes
        self.parts += (
            [prefix] + ([header] if header else []) + ([] if payload is None else [payload.numpy().tobytes()])
        )

    async def recv_exact(self, nbytes: int) -> bytes:
        part = self.parts.pop(0)
        assert len(part) == nbytes
        return part

    def abort(self) -> None:
        self.parts.clear()

    async def close(self) -> None:
        self.parts.clear()


def past_handshake(channel: MemoryChannel) -> FramedConnection:
    """A connection as the handshake leaves it at READY: authenticated, still checksummed."""
    conn = FramedConnection(channel, 1 << 20)
    conn.authenticated = True
    return conn


@pytest.mark.parametrize("checksum", [True, False])
def test_frame_round_trip_with_payload(checksum: bool) -> None:
    conn = past_handshake(MemoryChannel())
    conn.checksum = checksum
    payload = torch.randn(1, 2, 2, 16, 3, 64).to(torch.bfloat16)  # [nl, 2, n, B, Hkv, D]
    frame = asyncio.run(_send_recv(conn, EXAMPLES[8], payload))
    assert frame[0] == EXAMPLES[8]
    assert frame[1] is not None and torch.equal(frame[1].view(torch.bfloat16).view(payload.shape), payload)


async def _send_recv(
    conn: FramedConnection, msg: Message, payload: torch.Tensor
) -> tuple[Message, torch.Tensor | None]:
    await conn.send(msg, payload)
    frame = await conn.recv()
    return frame.msg, frame.payload


def test_flipped_bit_fails_the_checksum_and_names_the_transfer() -> None:
    channel = MemoryChannel()
    conn = past_handshake(channel)
    prefix, header, payload = encode_frame(EXAMPLES[8], torch.ones(64, dtype=torch.uint8), checksum=True)
    assert payload is not None
    damaged = payload.clone()
    damaged[7] ^= 0x80
    asyncio.run(channel.send(prefix, header, damaged))
    with pytest.raises(ChecksumError) as err:
        asyncio.run(conn.recv())
    assert err.value.transfer_id == "req-1"


def test_prefix_is_24_bytes_and_checked() -> None:
    assert PREFIX_SIZE == 24
    channel = MemoryChannel()
    conn = past_handshake(channel)
    prefix, header, _ = encode_frame(Ready(), None, checksum=True)
    magic, version, msg_type, flags, header_len, payload_len, _crc = PREFIX.unpack(prefix)
    assert (magic, version, msg_type, flags, header_len, payload_len) == (
        b"PDKV",
        PROTOCOL_VERSION,
        Ready.TYPE,
        1,
        len(header),
        0,
    )
    channel.parts += [prefix[:4] + bytes([PROTOCOL_VERSION + 1]) + prefix[5:], header]
    with pytest.raises(VersionMismatch, match=f"v{PROTOCOL_VERSION + 1}"):
        asyncio.run(conn.recv())
    channel.parts = [PREFIX.pack(b"PDKV", 1, Data.TYPE, 0, 10, 1 << 30, 0)]
    with pytest.raises(ProtocolError, match="too large"):
        asyncio.run(conn.recv())
    channel.parts = [prefix[:20] + struct.pack("<I", 0), header]
    with pytest.raises(ChecksumError):
        asyncio.run(conn.recv())


def test_without_checksums_a_data_payload_goes_before_its_header() -> None:
    channel = MemoryChannel()
    conn = past_handshake(channel)
    conn.checksum = False
    payload = torch.arange(64, dtype=torch.uint8)
    msg = EXAMPLES[8]
    assert isinstance(msg, Data)
    asyncio.run(conn.send_built(lambda: msg, payload))
    first, body, after, header = channel.parts
    assert (
        PREFIX.unpack(first)[2:6] == (Data.TYPE, FLAG_PAYLOAD_FIRST, 0, 64)
        and body == payload.numpy().tobytes()
    )
    assert PREFIX.unpack(after)[2:6] == (Data.TYPE, FLAG_HEADER_AFTER, len(header), 0)
    frame = asyncio.run(conn.recv())
    assert frame.msg == msg and frame.payload is not None and torch.equal(frame.payload, payload)
    assert channel.parts == []


def test_a_payload_whose_header_failed_is_dropped_by_d() -> None:
    channel = MemoryChannel()
    conn = past_handshake(channel)
    conn.checksum = False

    def fail() -> Data:
        raise ValueError("bad descriptor")

    with pytest.raises(ValueError, match="bad descriptor"):
        asyncio.run(conn.send_built(fail, torch.ones(32, dtype=torch.uint8)))
    assert PREFIX.unpack(channel.parts[-1])[3:6] == (FLAG_HEADER_AFTER, 0, 0)
    asyncio.run(conn.send(Ready()))
    frame = asyncio.run(conn.recv())  # the dropped payload is consumed and skipped
    assert frame.msg == Ready() and frame.payload is None and channel.parts == []


def test_payload_first_frames_out_of_order_are_protocol_errors() -> None:
    channel = MemoryChannel()
    conn = past_handshake(channel)
    conn.checksum = False
    first = PREFIX.pack(b"PDKV", PROTOCOL_VERSION, Data.TYPE, FLAG_PAYLOAD_FIRST, 0, 8, 0)
    ready_prefix, ready_header, _ = encode_frame(Ready(), None, checksum=False)
    channel.parts = [first, bytes(8), ready_prefix, ready_header]
    with pytest.raises(ProtocolError, match="instead of its header"):
        asyncio.run(conn.recv())
    channel.parts = [PREFIX.pack(b"PDKV", PROTOCOL_VERSION, Data.TYPE, FLAG_HEADER_AFTER, 0, 0, 0)]
    with pytest.raises(ProtocolError, match="without a payload before it"):
        asyncio.run(conn.recv())
    channel.parts = [
        PREFIX.pack(b"PDKV", PROTOCOL_VERSION, Ready.TYPE, FLAG_PAYLOAD_FIRST, 0, 8, 0),
        bytes(8),
    ]
    with pytest.raises(ProtocolError, match="bad payload-first frame"):
        asyncio.run(conn.recv())
    conn.checksum = True
    channel.parts = [first, bytes(8)]
    with pytest.raises(ProtocolError, match="checksum=True"):
        asyncio.run(conn.recv())


class HoldingChannel(MemoryChannel):
    """A channel that holds each received payload until framing releases it (as cuda_ipc does)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def release_payload(self) -> None:
        self.calls.append("release")

    async def recv_exact(self, nbytes: int) -> bytes:
        self.calls.append(f"read {nbytes}")
        return await super().recv_exact(nbytes)

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        self.calls.append(f"payload {nbytes}")
        return torch.frombuffer(bytearray(await super().recv_exact(nbytes)), dtype=torch.uint8)


def test_a_held_payload_is_released_only_when_the_next_frame_is_read() -> None:
    """Releasing between a payload-first frame and its header would free the payload before its consumers
    were queued."""
    channel = HoldingChannel()
    conn = past_handshake(channel)
    conn.checksum = False
    msg = EXAMPLES[8]
    assert isinstance(msg, Data)
    asyncio.run(conn.send_built(lambda: msg, torch.ones(16, dtype=torch.uint8)))
    asyncio.run(conn.send(Ready()))
    header_len = len(channel.parts[3])
    asyncio.run(conn.recv())
    assert channel.calls == ["release", "read 24", "payload 16", "read 24", f"read {header_len}"]
    channel.calls.clear()
    asyncio.run(conn.recv())
    assert channel.calls[0] == "release" and channel.calls.count("release") == 1


def test_a_deferred_payload_holds_back_the_next_payload_until_released() -> None:
    """The receiver keeps a payload that is still landing past the next `recv` (defer_release): frames without
    a payload are read meanwhile, but the next payload only after the release, which frees the held one."""
    msg = EXAMPLES[8]
    assert isinstance(msg, Data)

    async def scenario() -> None:
        channel = HoldingChannel()
        conn = past_handshake(channel)
        conn.checksum = False
        await conn.send_built(lambda: msg, torch.ones(16, dtype=torch.uint8))
        await conn.send(Ready())
        await conn.send_built(lambda: msg, torch.full((16,), 2, dtype=torch.uint8))
        assert isinstance((await conn.recv()).msg, Data)
        release = conn.defer_release()
        channel.calls.clear()
        assert isinstance((await conn.recv()).msg, Ready)
        assert "release" not in channel.calls
        second = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.01)
        assert not second.done() and channel.calls[-1] == "read 24"  # its prefix, not its payload
        release()
        frame = await second
        assert frame.payload is not None and frame.payload.tolist() == [2] * 16
        assert channel.calls.index("release") < channel.calls.index("payload 16")

    asyncio.run(scenario())
