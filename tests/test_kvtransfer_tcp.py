"""The TCP channel itself, over real sockets: frames and payloads of every size arrive whole and in order
while the reader lags (the socket is then left unread and read again), a payload lands straight in its
tensor, and a peer that hangs up or a channel that is aborted fails the pending read at once."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.tcp import TcpChannel, TcpTransport
from pdserve.tests.harness import transfer

MIB = 1 << 20


async def _pair() -> tuple[TcpChannel, TcpChannel, object]:
    accepted: asyncio.Queue[TcpChannel] = asyncio.Queue()

    async def on_channel(channel: object) -> None:
        assert isinstance(channel, TcpChannel)
        await accepted.put(channel)

    listener = await TcpTransport().listen("127.0.0.1", 0, on_channel)
    p = await TcpTransport().dial("127.0.0.1", listener.port, 5.0)
    assert isinstance(p, TcpChannel)
    return p, await accepted.get(), listener


@transfer.coroutine_test
async def test_frames_arrive_whole_and_in_order_while_the_reader_lags() -> None:
    """Sizes from 1 B to well past what the channel holds unread (so it stops reading the socket and
    resumes): the reader starts only once the writer has sent all it could, and every byte matches."""
    p, d, listener = await _pair()
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, 4096, 300_000, 5 * MIB, 9 * MIB + 3, 24]
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]

    async def write() -> None:
        for i, payload in enumerate(payloads):
            await p.send(b"P%07d" % i, b"header-%d" % i, payload)

    writer = asyncio.create_task(write())
    await asyncio.sleep(0.3)  # the unread bytes pile up on D's side
    for i, payload in enumerate(payloads):
        assert await d.recv_exact(8) == b"P%07d" % i
        assert await d.recv_exact(len(b"header-%d" % i)) == b"header-%d" % i
        got = await d.recv_payload(payload.numel())
        assert got.dtype == torch.uint8 and torch.equal(got, payload), f"payload {i} ({sizes[i]} B)"
    await writer
    await p.close()
    await d.close()
    await listener.close()  # type: ignore[attr-defined]


@transfer.coroutine_test
async def test_a_peer_hanging_up_mid_payload_fails_the_read() -> None:
    p, d, listener = await _pair()
    await p.send(b"prefix", b"", torch.zeros(1000, dtype=torch.uint8))
    await p.close()
    assert await d.recv_exact(6) == b"prefix"
    with pytest.raises(ConnectionLost, match="1000 of 4000"):
        await d.recv_payload(4000)
    with pytest.raises(ConnectionLost):
        await d.recv_exact(1)
    assert d.closed
    await listener.close()  # type: ignore[attr-defined]


@transfer.coroutine_test
async def test_abort_fails_the_pending_read_and_every_later_call() -> None:
    p, d, listener = await _pair()
    pending = asyncio.create_task(d.recv_payload(1 << 20))
    await asyncio.sleep(0.05)
    heard = d.heard_at
    await p.send(b"", b"", torch.ones(10, dtype=torch.uint8))
    for _ in range(100):
        if d.heard_at > heard:
            break
        await asyncio.sleep(0.01)
    assert d.heard_at > heard, "bytes that landed in a pending payload count as heard"
    d.abort()
    with pytest.raises(ConnectionLost):
        await pending
    with pytest.raises(ConnectionLost):
        await d.send(b"x", b"", None)
    with pytest.raises(ConnectionLost):
        await p.recv_exact(1)  # P sees D's end go
    await listener.close()  # type: ignore[attr-defined]


@transfer.coroutine_test
async def test_a_failing_connection_handler_cuts_its_connection_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def on_channel(channel: object) -> None:
        raise RuntimeError("handler bug")

    listener = await TcpTransport().listen("127.0.0.1", 0, on_channel)
    p = await TcpTransport().dial("127.0.0.1", listener.port, 5.0)
    with caplog.at_level(logging.ERROR, logger="pdserve.kvtransfer"), pytest.raises(ConnectionLost):
        await p.recv_exact(1)  # P sees D's end go instead of waiting on an orphaned connection
    assert "connection handler for" in caplog.text and "handler bug" in caplog.text
    await listener.close()
