"""The KV-transfer protocol suite, run unchanged over every connector (TCP, UCX).

Two real paged caches, real sockets/endpoints on loopback, gather/scatter by the reference ops; raw clients
built from the same framing code play a misbehaving sender (cut, corrupted frame, bad proof). The in-process
scenarios live in tests/harness/transfer_suite.py (the pair-group tests run them too); the cross-process
tests here run tests/harness/transfer.py, where the scenarios' parts live, as the sender's script.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from pdserve.kvtransfer.connector import (
    ConnectionLost,
    create_sender,
)
from pdserve.kvtransfer.framing import ByteChannel
from pdserve.kvtransfer.tcp import TcpTransport
from pdserve.kvtransfer.ucx import UcxOptions
from pdserve.shared.types import FirstToken, RequestId
from pdserve.tests.harness.transfer import (
    KINDS,
    LAYOUT,
    UCX,
    XPROC_BLOCKS,
    PagedReceiver,
    audit,
    block_hashes,
    config,
    hung_sender,
    identity,
    needs_ucx,
    pair,
    push,
    random_cache,
    run,
    spawn_sender,
    started,
    until,
)
from pdserve.tests.harness.transfer_suite import CASE_IDS, CASES, Scenario, run_case

if UCX:
    import ucxx
    from pdserve.kvtransfer.ucx_transport import RECORD, UcxChannel, UcxTransport, progress_mode


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("scenario", "params"), CASES, ids=CASE_IDS)
def test_protocol_suite(
    kind: str, scenario: Scenario, params: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    run_case(kind, scenario, params, caplog)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_transfer_across_processes_is_bit_identical(kind: str) -> None:
    async def scenario() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=16)
        server = await started(kind, receiver)
        try:
            proc = await spawn_sender(kind, server.address, "full")
            out, _ = await proc.communicate()
            assert proc.returncode == 0 and out.startswith(b"done"), out
            src = random_cache(LAYOUT, 12, seed=3)
            dst = receiver.reserved["xproc"]
            for s, d in zip(XPROC_BLOCKS, dst, strict=True):
                assert torch.equal(receiver.kv[:, :, d], src[:, :, s])
            assert receiver.completed["xproc"] == FirstToken(7, -0.25)
            await until(lambda: not server.open_transfer_ids())
            audit(receiver, server, 16)
        finally:
            await server.stop()

    run(scenario())


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_killed_sender_process_aborts_exactly_once(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """Also: the receives D had posted for the dead connection (ucx's standing receive) end without an error
    that nobody read."""

    async def scenario() -> None:
        async with hung_sender(kind) as (receiver, server, proc):
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await until(lambda: receiver.aborts)
            await asyncio.sleep(0.3)
            assert [t for t, _ in receiver.aborts] == ["xproc"]
            audit(receiver, server, 16)

    run(scenario())
    gc.collect()  # a task whose exception nobody read reports it when collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_stopped_sender_is_cut_by_liveness_not_by_the_deadline(kind: str) -> None:
    """SIGSTOP of the sender mid-transfer (its deadline is a minute away): D hears no PING for its liveness
    window, cuts the connection, aborts the transfer once and says which peer went silent."""

    async def scenario() -> None:
        async with hung_sender(kind, liveness_s=1.0) as (receiver, server, proc):
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await until(lambda: receiver.silent)
            assert time.monotonic() - stopped < 1.0 + 1.0  # the window, plus a ping interval's slack
            assert [t for t, _ in receiver.aborts] == ["xproc"]
            assert "silent" in receiver.aborts[0][1]
            assert [p for p, _ in receiver.silent] == ["prefill-proc"]
            audit(receiver, server, 16)

    run(scenario())


@pytest.mark.extras
@needs_ucx
def test_ucx_sender_pipelines_payloads_in_order() -> None:
    """UcxChannel.send returns once a frame's prefix is written and its payload posted: three 1 MiB payloads
    (UCX's rendezvous protocol, which needs the receiver's matching recv) go out before D reads anything, and
    D then reads every frame's control bytes (over TCP) and payload (over UCX) in the order they were sent.
    Closing the sender leaves no payload request behind."""

    async def scenario() -> None:
        received: list[bytes] = []
        go, done = asyncio.Event(), asyncio.Event()
        accepted: asyncio.Future[ByteChannel] = asyncio.get_running_loop().create_future()

        async def on_channel(channel: ByteChannel) -> None:
            accepted.set_result(channel)
            await channel.authenticated()
            await go.wait()
            for _ in range(3):
                received.append(await channel.recv_exact(4) + await channel.recv_exact(3))
                received.append(bytes((await channel.recv_payload(1 << 20))[:8].numpy()))
            done.set()
            await asyncio.sleep(1.0)  # keep the endpoint up while the sender settles
            await channel.close()

        d_transport, p_transport = UcxTransport(config("ucx")), UcxTransport(config("ucx"))
        listener = await d_transport.listen("127.0.0.1", 0, on_channel)
        channel = await p_transport.dial("127.0.0.1", listener.port, 5.0)
        assert isinstance(channel, UcxChannel)
        async with asyncio.timeout(10.0):
            await channel.authenticated()
        payloads = [torch.full((1 << 20,), i + 1, dtype=torch.uint8) for i in range(3)]
        for i, payload in enumerate(payloads):
            async with asyncio.timeout(10.0):
                await channel.send(b"pfx" + bytes([i]), b"hdr", payload)
        assert not received and len(channel._in_flight) >= 1  # sent ahead of D's reads
        go.set()
        async with asyncio.timeout(10.0):
            await done.wait()
        assert received == [x for i in range(3) for x in (b"pfx" + bytes([i]) + b"hdr", bytes([i + 1]) * 8)]
        await channel.close()
        assert not channel._in_flight
        await listener.close()

    run(scenario())


@pytest.mark.extras
@needs_ucx
def test_ucx_endpoint_with_an_unknown_key_is_dropped() -> None:
    """D's UCX listener hands an endpoint only to the connection whose record named its key: a peer that
    connects with other bytes gets nothing, and the connection that waits for its endpoint gives up after
    the handshake timeout with ConnectionLost."""

    async def scenario() -> None:
        d_transport = UcxTransport(config("ucx", handshake_timeout_s=1.0))
        outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        async def on_channel(channel: ByteChannel) -> None:
            try:
                await channel.authenticated()
            except ConnectionLost as e:
                outcome.set_result(e)
            else:
                outcome.set_result(None)
            channel.abort()

        listener = await d_transport.listen("127.0.0.1", 0, on_channel)
        control = await TcpTransport().dial("127.0.0.1", listener.port, 5.0)
        record = await control.recv_exact(RECORD.size)
        assert record[:4] == b"PDUX"
        port = int.from_bytes(record[4:6], "little")
        endpoint = await ucxx.create_endpoint("127.0.0.1", port)
        await endpoint.send(np.frombuffer(os.urandom(16), dtype=np.uint8))  # not the key D sent
        async with asyncio.timeout(10.0):
            failure = await outcome
        assert isinstance(failure, ConnectionLost)
        endpoint.abort()
        control.abort()
        await listener.close()

    run(scenario())


@pytest.mark.extras
@needs_ucx
def test_ucx_payloads_over_and_under_the_window_are_bit_identical() -> None:
    """D's standing receive takes the payloads that fit its window (tag WINDOW), a receive posted at the
    prefix takes larger ones (tag LATE): with a 2 KiB window, each transfer's 3-layer frames (4.5 KiB) and
    1-layer frames (1.5 KiB) alternate on one connection, three sessions at once, and every block arrives
    bit for bit."""

    async def scenario() -> None:
        async with pair("ucx", 16, options=UcxOptions(window_bytes=2048)) as (receiver, server, sender):
            src = random_cache(LAYOUT, 12, seed=5)
            assert 4 * LAYOUT.layer_block_bytes <= 2048 < 3 * 4 * LAYOUT.layer_block_bytes
            for round_ in range(2):
                tids = [RequestId(f"w{round_}-{i}") for i in range(3)]
                sessions = [await sender.session(server.address, tid) for tid in tids]
                picks = [[i, i + 3, i + 6, 11 - i] for i in range(3)]
                results = await asyncio.gather(
                    *(
                        push(s, src, picks[i], block_hashes(4, salt=10 * round_ + i), layers_per_frame=3)
                        for i, s in enumerate(sessions)
                    )
                )
                for i, (reply, _) in enumerate(results):
                    for j, b in enumerate(reply.dst_block_ids):
                        assert torch.equal(receiver.kv[:, :, b], src[:, :, picks[i][j]])
                    receiver.free.extend(reply.dst_block_ids)
            assert len(receiver.completed) == 6

    run(scenario())


@pytest.mark.extras
@needs_ucx
def test_an_idle_ucx_connection_leaves_the_event_loop_idle() -> None:
    """With D's standing receive posted and nothing sent, neither end's event loop turns: the thread that runs
    it uses (almost) no CPU while it sleeps. ucxx awaiting a request without Python futures spun the loop
    without pause, which took the GIL from the node's engine thread every few microseconds."""

    async def scenario() -> None:
        accepted: asyncio.Future[ByteChannel] = asyncio.get_running_loop().create_future()

        async def on_channel(channel: ByteChannel) -> None:
            await channel.authenticated()
            accepted.set_result(channel)

        d_transport = UcxTransport(config("ucx", options=UcxOptions(window_bytes=1 << 20)))
        listener = await d_transport.listen("127.0.0.1", 0, on_channel)
        p_channel = await UcxTransport(config("ucx")).dial("127.0.0.1", listener.port, 5.0)
        async with asyncio.timeout(10.0):
            await p_channel.authenticated()
            d_channel = await accepted
        assert isinstance(d_channel, UcxChannel) and d_channel._standing is not None
        cpu = time.thread_time()
        await asyncio.sleep(1.0)
        assert time.thread_time() - cpu < 0.2  # a spinning loop uses the whole second
        await p_channel.close()
        await d_channel.close()
        await listener.close()

    run(scenario())


@pytest.mark.extras
@needs_ucx
def test_ucx_progress_mode_follows_the_config() -> None:
    """The "auto" mode polls on a GPU and sleeps on host memory; an unknown mode is refused at config time."""
    assert progress_mode(config("ucx")) == "thread"
    assert progress_mode(config("ucx", device="cuda:0")) == "thread-polling"
    assert progress_mode(config("ucx", options=UcxOptions(progress="thread-polling"))) == "thread-polling"
    with pytest.raises(ValueError, match="progress"):
        UcxOptions(progress="busy")
    with pytest.raises(ValueError, match="do not fit kind 'tcp'"):
        config("tcp", options=UcxOptions())


@pytest.mark.extras
@needs_ucx
def test_a_closed_ucx_connection_leaves_no_window_behind() -> None:
    """After a transfer and the connection's end (P closes, then D stops), nothing references D's window:
    ucxx keeps a failed request's exception for good, so its traceback, which named the receive's buffer
    (the window), must not travel with it."""
    window = (3 << 20) + 4096  # a size no other buffer here has

    def windows_alive() -> int:
        gc.collect()
        storages = {
            o.untyped_storage().data_ptr()
            for o in gc.get_objects()
            if type(o) is torch.Tensor and o.untyped_storage().nbytes() == window
        }
        return len(storages)

    async def scenario() -> None:
        handler = PagedReceiver(LAYOUT, 32)
        server = await started("ucx", handler, options=UcxOptions(window_bytes=window))
        sender = create_sender(config("ucx"), identity("prefill-0"))
        src = random_cache(LAYOUT, 16, seed=5)
        for i in range(3):
            await push(await sender.session(server.address, RequestId(f"t{i}")), src, [1, 2, 3], [])
        assert windows_alive() == 1  # D's, while the connection lives
        await sender.close()
        await until(lambda: not server.open_transfer_ids())
        await server.stop()
        await asyncio.sleep(0.2)  # the cancelled standing receive reaches its end
        assert windows_alive() == 0

    run(scenario())
