"""A fuzzer over the transfer frame decoder (issue 20): random byte streams, and valid frames mutated (bytes
flipped, cut, inserted, spliced), fed to `FramedConnection.recv` as a peer would send them.

Properties: the decoder only ever returns a frame or raises the protocol's own clean errors (ProtocolError,
its ChecksumError and VersionMismatch, or ConnectionLost when the input ends); before authentication no
frame carries a payload, no payload is ever read, and nothing beyond a frame's 24-byte prefix is read from a
prefix that announces one; a decoded message is one of the protocol's types. The receiver's dispatch of
decoded frames (random descriptors in DATA, unknown transfers, payloads where none belong) raises at most
ProtocolError and leaves every reservation either completed or given back.
"""

from __future__ import annotations

import asyncio
import struct

import crc32c
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdserve.kvtransfer.common import ConnectionLost, ProtocolError
from pdserve.kvtransfer.framing import (
    CRC_COVERED,
    FLAG_CHECKSUM,
    MAGIC,
    MAX_HANDSHAKE_HEADER_BYTES,
    PREFIX,
    PREFIX_SIZE,
    Frame,
    FramedConnection,
    encode_frame,
)
from pdserve.kvtransfer.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Complete,
    Data,
    Message,
    Open,
    Ping,
)
from pdserve.kvtransfer.receiver import ChannelServer
from pdserve.kvtransfer.tcp import TcpTransport
from pdserve.shared.types import FirstToken, NodeId, RequestId
from pdserve.tests.harness.memory_channel import InMemoryChannel
from pdserve.tests.harness.messages import EXAMPLES
from pdserve.tests.harness.transfer import LAYOUT, PagedReceiver, config, identity

MAX_PAYLOAD = 1 << 16
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class StreamChannel(InMemoryChannel):
    """A peer's bytes as a stream: reads past the end raise ConnectionLost; records what was read how."""

    peer_name = "fuzz"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.payload_reads = 0
        self.sent: list[bytes] = []

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        self.sent.append(prefix + header)

    async def recv_exact(self, nbytes: int) -> bytes:
        assert nbytes > 0, "framing never asks for 0 bytes"
        if self.pos + nbytes > len(self.data):
            self.pos = len(self.data)
            raise ConnectionLost("end of input")
        chunk = self.data[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return chunk

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        self.payload_reads += 1
        return await super().recv_payload(nbytes)


def frame_bytes(msg: Message, payload: bytes | None, checksum: bool) -> bytes:
    body = None if payload is None else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    prefix, header, data = encode_frame(msg, body, checksum)
    return prefix + header + (b"" if data is None else data.numpy().tobytes())


def decode_all(data: bytes, authenticated: bool, checksum: bool) -> tuple[StreamChannel, list[Message]]:
    """Reads frames until the input ends or the decoder refuses it; asserts only clean errors come out."""
    channel = StreamChannel(data)
    conn = FramedConnection(channel, MAX_PAYLOAD)
    conn.authenticated = authenticated
    conn.checksum = checksum
    messages: list[Message] = []

    async def run() -> None:
        while True:
            start = channel.pos
            try:
                frame = await conn.recv()
            except (ProtocolError, ConnectionLost):
                if not authenticated:  # refused from its prefix: nothing of a payload was read
                    assert channel.pos - start <= PREFIX_SIZE + MAX_HANDSHAKE_HEADER_BYTES
                return
            assert type(frame.msg) in MESSAGE_TYPES.values()
            assert frame.payload is None or frame.payload.numel() <= MAX_PAYLOAD
            if not authenticated:
                assert frame.payload is None, "a frame before authentication carried a payload"
            messages.append(frame.msg)

    asyncio.run(run())
    if not authenticated:
        assert channel.payload_reads == 0
    return channel, messages


@FUZZ
@given(data=st.binary(max_size=4096), authenticated=st.booleans(), checksum=st.booleans())
def test_random_bytes_decode_cleanly(data: bytes, authenticated: bool, checksum: bool) -> None:
    decode_all(data, authenticated, checksum)


@FUZZ
@given(
    header_len=st.integers(0, (1 << 32) - 1),
    payload_len=st.integers(0, (1 << 64) - 1),
    msg_type=st.integers(0, 255),
    flags=st.integers(0, 255),
    tail=st.binary(max_size=256),
)
def test_random_prefixes_decode_cleanly(
    header_len: int, payload_len: int, msg_type: int, flags: int, tail: bytes
) -> None:
    """Valid magic and version, any sizes, type and flags: oversized announcements are refused unread."""
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, msg_type, flags, header_len, payload_len, 0)
    for authenticated in (False, True):
        for checksum in (False, True):
            channel, _ = decode_all(prefix + tail, authenticated, checksum)
            if not authenticated and payload_len:
                assert channel.pos == PREFIX_SIZE, "a payload announced before authentication was read"


def valid_stream(checksum: bool) -> bytes:
    """One of every message, DATA with a small payload, as one peer's byte stream."""
    parts = []
    for msg in EXAMPLES:
        payload = bytes(range(64)) if isinstance(msg, Data) else None
        parts.append(frame_bytes(msg, payload, checksum))
    return b"".join(parts)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 32)),
)


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, at, value in mutations:
        i = at % (len(buf) + 1)
        if kind == "flip" and i < len(buf):
            buf[i] ^= value
        elif kind == "cut":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = bytes([value])
        elif kind == "delete":
            del buf[i : i + value]
    return bytes(buf)


@FUZZ
@given(
    mutations=st.lists(mutation, min_size=1, max_size=6), authenticated=st.booleans(), checksum=st.booleans()
)
def test_mutated_frames_decode_cleanly(
    mutations: list[tuple[str, int, int]], authenticated: bool, checksum: bool
) -> None:
    decode_all(mutate(valid_stream(checksum), mutations), authenticated, checksum)


def test_a_checksummed_frame_with_a_flipped_byte_is_never_accepted() -> None:
    """Every single-byte flip of a checksummed DATA frame is refused (CRC32 catches every 1-byte error)."""
    frame = frame_bytes(EXAMPLES[8], bytes(range(64)), checksum=True)
    for i in range(len(frame)):
        for value in (0x01, 0x80, 0xFF):
            _, messages = decode_all(mutate(frame, [("flip", i, value)]), True, True)
            assert messages == [], f"byte {i} ^ {value:#x} was accepted"


def test_a_forged_checksum_does_not_let_a_payload_through_before_authentication() -> None:
    """A well-formed, correctly checksummed frame announcing a payload is refused from its prefix."""
    header = b"\x80"  # an empty msgpack map
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, Ping.TYPE, FLAG_CHECKSUM, len(header), 8, 0)
    payload = b"\x00" * 8
    crc = crc32c.crc32c(payload, crc32c.crc32c(header, crc32c.crc32c(prefix[:CRC_COVERED])))
    frame = prefix[:CRC_COVERED] + struct.pack("<I", crc) + header + payload
    channel, messages = decode_all(frame, authenticated=False, checksum=True)
    assert messages == [] and channel.pos == PREFIX_SIZE


tids = st.sampled_from(["t0", "t1", "zz"])
small = st.lists(st.integers(-2, 12), max_size=6).map(tuple)
decoded = st.one_of(
    st.builds(Data, tids, st.integers(-1, 5), st.integers(0, 5), small, small, small),
    st.builds(Complete, tids, st.just(FirstToken(1))),
    st.builds(Abort, tids, st.text(max_size=8)),
    st.just(Ping()),
    st.sampled_from([m for m in EXAMPLES if not isinstance(m, Data | Complete | Abort | Ping | Open)]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(
        st.tuples(decoded, st.one_of(st.none(), st.integers(0, 4 * LAYOUT.layer_block_bytes))), max_size=12
    )
)
def test_the_receiver_survives_any_decoded_frame(frames: list[tuple[Message, int | None]]) -> None:
    """After two OPENs, any sequence of decoded frames: dispatch raises at most ProtocolError, and every
    reservation ends completed or given back once the connection's transfers are aborted."""

    async def run() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=16)
        server = ChannelServer(TcpTransport(), config("tcp"), identity("decode-0"), receiver)
        conn = FramedConnection(StreamChannel(b""), MAX_PAYLOAD)
        conn.authenticated = True
        server._connections[conn.channel] = asyncio.get_running_loop().create_future()
        peer = NodeId("prefill-fuzz")
        for tid in ("t0", "t1"):
            await server._dispatch(conn, peer, _frame(Open(RequestId(tid), (), 3, 4e9), None))
        await asyncio.gather(*server._landings)
        assert server.open_transfer_ids() == {"t0", "t1"}
        for msg, nbytes in frames:
            try:
                await server._dispatch(conn, peer, _frame(msg, nbytes))
            except ProtocolError:
                break
        await asyncio.gather(*server._landings)
        for t in list(server._transfers.values()):
            await server._abort(t, "fuzz over", notify=False)
        assert server.open_transfer_ids() == frozenset()
        assert sorted(receiver.free + [b for t in receiver.completed for b in receiver.reserved[t]]) == list(
            range(16)
        )

    asyncio.run(run())


def _frame(msg: Message, nbytes: int | None) -> Frame:
    payload = None if nbytes is None else torch.zeros(nbytes, dtype=torch.uint8)
    return Frame(msg, payload)
