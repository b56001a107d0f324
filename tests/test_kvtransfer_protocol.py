"""The KV-transfer protocol suite, run unchanged over every connector (TCP, UCX).

Two real paged caches, real sockets/endpoints on loopback, gather/scatter by the reference ops; raw clients
built from the same framing code play a misbehaving sender (cut, corrupted frame, bad proof). The
cross-process tests run tests/harness/transfer.py, where the scenarios' parts live, as the sender's script.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from pdserve.kvtransfer.connector import (
    ConnectionLost,
    FrameBlocks,
    HandshakeError,
    KVLayout,
    TransferAborted,
    TransferRefused,
    create_sender,
)
from pdserve.kvtransfer.framing import PREFIX, PREFIX_SIZE, ByteChannel, FramedConnection, encode_frame
from pdserve.kvtransfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Auth,
    Error,
    Hello,
    Open,
    OpenOk,
    OpenRefusal,
)
from pdserve.kvtransfer.tcp import TcpTransport
from pdserve.kvtransfer.transport import parse_address
from pdserve.kvtransfer.ucx import UcxOptions
from pdserve.shared.types import FirstToken, RequestId
from pdserve.tests.harness.transfer import (
    KINDS,
    LAYOUT,
    TOKEN,
    TRANSPORTS,
    UCX,
    XPROC_BLOCKS,
    PagedReceiver,
    audit,
    block_hashes,
    config,
    data_frame,
    identity,
    needs_ucx,
    pair,
    push,
    random_cache,
    raw_sender,
    run,
    spawn_sender,
    started,
    until,
)

if UCX:
    import ucxx
    from pdserve.kvtransfer.ucx_transport import RECORD, UcxChannel, UcxTransport, progress_mode


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("checksum", [True, False])
def test_full_transfer_is_bit_identical(kind: str, checksum: bool) -> None:
    async def scenario() -> None:
        async with pair(kind, 16, sender_config={"checksum": checksum}, checksum=checksum) as (
            receiver,
            server,
            sender,
        ):
            src = random_cache(LAYOUT, 12, seed=1)
            hashes = block_hashes(5)
            src_blocks = [9, 2, 7, 4, 11]  # 5 full blocks + 1 partial
            for h, b in zip(hashes[:2], src_blocks[:2], strict=True):  # D already holds the first two
                receiver.kv[:, :, receiver.hold(h)] = src[:, :, b]
            session = await sender.session(server.address, RequestId("req-1"))
            reply, stats = await push(session, src, [*src_blocks, 5], hashes, layers_per_frame=3)
            assert reply.num_held_blocks == 2 and len(reply.dst_block_ids) == 4
            assert stats.payload_bytes == LAYOUT.num_layers * 4 * LAYOUT.layer_block_bytes
            assert receiver.completed == {"req-1": FirstToken(7, -0.25)}
            for j, i in enumerate(range(2, 6)):
                assert torch.equal(receiver.kv[:, :, reply.dst_block_ids[j]], src[:, :, [*src_blocks, 5][i]])
            untouched = set(receiver.free)
            assert all(not receiver.kv[:, :, b].any() for b in untouched)
            audit(receiver, server, 16)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_sessions_are_multiplexed_on_one_connection(kind: str) -> None:
    async def scenario() -> None:
        async with pair(kind, 16) as (receiver, server, sender):
            src = random_cache(LAYOUT, 8, seed=2)
            sessions = [await sender.session(server.address, RequestId(f"r{i}")) for i in range(3)]
            results = await asyncio.gather(
                *(push(s, src, [i, i + 3], block_hashes(2, salt=i)) for i, s in enumerate(sessions))
            )
            for i, (reply, _) in enumerate(results):
                for j, b in enumerate(reply.dst_block_ids):
                    assert torch.equal(receiver.kv[:, :, b], src[:, :, [i, i + 3][j]])
            assert sorted(receiver.completed) == ["r0", "r1", "r2"]
            audit(receiver, server, 16)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrong_side", ["sender", "receiver"])
def test_wrong_token_is_refused(kind: str, wrong_side: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")

    async def scenario() -> None:
        sender_token = "other" if wrong_side == "sender" else TOKEN
        receiver_token = "other" if wrong_side == "receiver" else TOKEN
        async with pair(kind, 4, sender_config={"auth_token": sender_token}, auth_token=receiver_token) as (
            receiver,
            server,
            sender,
        ):
            with pytest.raises(HandshakeError) as err:
                await sender.session(server.address, RequestId("r"))
            assert err.value.code == "auth"
            await until(lambda: "refused sender" in caplog.text)  # D logged it too
            assert "handshake with" in caplog.text
            audit(receiver, server, 4)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_checks_the_senders_proof(kind: str) -> None:
    async def scenario() -> None:
        server = await started(kind, PagedReceiver(LAYOUT, 4))
        host, port = parse_address(server.address, kind)
        conn = FramedConnection(await TRANSPORTS[kind]().dial(host, port, 5.0), 1 << 20)
        try:
            me = identity("forger")
            hello = Hello(PROTOCOL_VERSION, me.node_id, me.fingerprint, me.layout, os.urandom(32), True)
            await conn.send(hello)
            assert isinstance((await conn.recv()).msg, Hello)  # D proves itself first
            await conn.send(Auth(b"\0" * 32))  # a sender that does not know the token
            refusal = (await conn.recv()).msg
            assert isinstance(refusal, Error) and refusal.code == "auth"
        finally:
            conn.channel.abort()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("change", "code", "named"),
    [
        ({"fingerprint": b"\x22" * 32}, "fingerprint", "fingerprint"),
        ({"layout": KVLayout(4, 3, 8, 16, "bfloat16")}, "layout", "block_size"),
        ({"layout": KVLayout(4, 3, 8, 4, "float16")}, "layout", "dtype"),
        ({"layout": KVLayout(4, 1, 8, 4, "bfloat16", tp_size=3)}, "layout", "num_kv_heads"),
    ],
)
def test_incompatible_peer_is_refused_naming_the_field(
    kind: str, change: dict[str, Any], code: str, named: str
) -> None:
    async def scenario() -> None:
        async with pair(kind, 4, sender_identity=identity("prefill-0", **change)) as (
            receiver,
            server,
            sender,
        ):
            with pytest.raises(HandshakeError) as err:
                await sender.session(server.address, RequestId("r"))
            assert err.value.code == code and named in str(err.value)
            audit(receiver, server, 4)

    run(scenario())


def test_ends_of_other_tensor_parallel_sizes_exchange_blocks() -> None:
    """Frames carry every KV head whatever either end's size: the handshake states tp_size only."""

    async def scenario() -> None:
        p3 = identity("prefill-0", layout=dataclasses.replace(LAYOUT, tp_size=3))
        async with pair("tcp", 8, sender_identity=p3) as (receiver, server, sender):
            src = random_cache(LAYOUT, 4, seed=2)
            session = await sender.session(server.address, RequestId("r"))
            reply, _ = await push(session, src, [1, 3], block_hashes(1), layers_per_frame=2)
            for j, b in enumerate([1, 3]):
                assert torch.equal(receiver.kv[:, :, reply.dst_block_ids[j]], src[:, :, b])
            audit(receiver, server, 8)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_sender_abort_frees_the_reservation(kind: str) -> None:
    async def scenario() -> None:
        async with pair(kind, 8) as (receiver, server, sender):
            session = await sender.session(server.address, RequestId("r"))
            reply = await session.open(block_hashes(3), 3, time.time() + 30)
            assert server.open_transfer_ids() == {"r"} and len(receiver.free) == 5
            await session.abort("client disconnected")
            await session.abort("twice is a no-op")
            await until(lambda: receiver.aborts)
            assert receiver.aborts == [("r", "sender aborted: client disconnected")]
            with pytest.raises(TransferAborted):
                await session.send_layers(0, FrameBlocks((), (), ()), torch.empty(0))
            assert len(reply.dst_block_ids) == 3
            audit(receiver, server, 8)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_open_refusal_reserves_nothing(kind: str) -> None:
    async def scenario() -> None:
        async with pair(kind, 2) as (receiver, server, sender):
            session = await sender.session(server.address, RequestId("big"))
            with pytest.raises(TransferRefused, match="need 3 blocks, 2 free"):
                await session.open(block_hashes(3), 3, time.time() + 30)
            late = await sender.session(server.address, RequestId("late"))
            with pytest.raises(TransferRefused, match="deadline"):  # P does not even ask
                await late.open(block_hashes(1), 1, time.time() - 1)
            conn = await raw_sender(kind, server)  # D checks it too
            await conn.send(Open(RequestId("late"), (), 1, time.time() - 1))
            refusal = (await conn.recv()).msg
            conn.channel.abort()
            assert isinstance(refusal, OpenRefusal) and "deadline" in refusal.reason
            audit(receiver, server, 2)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_aborts_at_the_deadline(kind: str) -> None:
    async def scenario() -> None:
        async with pair(kind, 8, sender_config={"ack_grace_s": 5.0}) as (receiver, server, sender):
            session = await sender.session(server.address, RequestId("slow"))
            await session.open(block_hashes(2), 2, time.time() + 0.3)
            await until(lambda: receiver.aborts)
            assert receiver.aborts[0][0] == "slow" and "deadline" in receiver.aborts[0][1]
            await asyncio.sleep(0.1)  # P learns of it from D's ABORT frame
            with pytest.raises(TransferAborted, match="deadline"):
                await session.complete(FirstToken(1))
            assert len(receiver.aborts) == 1
            audit(receiver, server, 8)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_connection_cut_midway_aborts_exactly_once(kind: str) -> None:
    async def scenario() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=8)
        server = await started(kind, receiver)
        conn = await raw_sender(kind, server)
        try:
            for tid in ("a", "b"):
                await conn.send(Open(RequestId(tid), (), 2, time.time() + 30))
                assert isinstance((await conn.recv()).msg, OpenOk)
            await conn.send(Open(RequestId("c"), (), 1, time.time() + 30))
            reply = (await conn.recv()).msg
            assert isinstance(reply, OpenOk)
            await conn.send(*data_frame("c", reply))
            await until(lambda: receiver.data_calls == 1)
            conn.channel.abort()  # the sender's socket/endpoint dies mid-transfer
            await until(lambda: len(receiver.aborts) == 3)
            await asyncio.sleep(0.2)
            assert sorted(t for t, _ in receiver.aborts) == ["a", "b", "c"]
            assert all("connection" in reason for _, reason in receiver.aborts)
            audit(receiver, server, 8)
        finally:
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_frame_aborts_that_transfer(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=8)
        server = await started(kind, receiver)
        conn = await raw_sender(kind, server)
        try:
            await conn.send(Open(RequestId("bad"), (), 2, time.time() + 30))
            reply = (await conn.recv()).msg
            assert isinstance(reply, OpenOk)
            prefix, header, payload = encode_frame(*data_frame("bad", reply), checksum=True)
            assert payload is not None
            damaged = payload.clone()
            damaged[100] ^= 0x01  # one bit flipped on the wire
            await conn.channel.send(prefix, header, damaged)
            abort = (await conn.recv()).msg
            assert isinstance(abort, Abort) and "checksum" in abort.reason
            assert receiver.aborts == [("bad", abort.reason)] and receiver.data_calls == 0
            assert "corrupted frame" in caplog.text
            await conn.send(
                Open(RequestId("next"), (), 1, time.time() + 30)
            )  # the connection itself survives
            assert isinstance((await conn.recv()).msg, OpenOk)
            await conn.send(Abort("next", "done"))
            await until(lambda: len(receiver.aborts) == 2)
            audit(receiver, server, 8)
        finally:
            conn.channel.abort()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_other_protocol_version_is_refused(kind: str) -> None:
    FUTURE = PROTOCOL_VERSION + 1

    async def scenario() -> None:
        server = await started(kind, PagedReceiver(LAYOUT, 4))
        host, port = parse_address(server.address, kind)
        conn = FramedConnection(await TRANSPORTS[kind]().dial(host, port, 5.0), 1 << 20)
        me = identity("future")
        try:
            prefix, header, _ = encode_frame(
                Hello(FUTURE, me.node_id, me.fingerprint, me.layout, os.urandom(32), True),
                None,
                checksum=False,
            )
            await conn.channel.send(prefix[:4] + bytes([FUTURE]) + prefix[5:], header, None)
            refusal = (await conn.recv()).msg
            assert isinstance(refusal, Error) and refusal.code == "version" and f"v{FUTURE}" in refusal.detail
        finally:
            conn.channel.abort()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_hello_announcing_a_payload_is_refused_from_its_prefix(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before authentication no frame may carry a payload: a HELLO announcing 64 MiB is refused once its
    24-byte prefix is read. The peer sends the prefix and header only, never the 64 MiB; D still hangs up
    at once, long before its 10 s handshake timeout (it used to wait to read the payload in full)."""
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")

    async def scenario() -> None:
        server = await started(kind, PagedReceiver(LAYOUT, 4))
        host, port = parse_address(server.address, kind)
        channel = await TRANSPORTS[kind]().dial(host, port, 5.0)
        me = identity("greedy")
        try:
            hello = Hello(PROTOCOL_VERSION, me.node_id, me.fingerprint, me.layout, os.urandom(32), True)
            prefix, header, _ = encode_frame(hello, None, checksum=True)
            big = PREFIX.pack(*PREFIX.unpack(prefix)[:5], 64 << 20, PREFIX.unpack(prefix)[6])
            t0 = time.monotonic()
            await channel.send(big, header, None)
            with pytest.raises(ConnectionLost):
                await channel.recv_exact(PREFIX_SIZE)  # D closes without a word
            assert time.monotonic() - t0 < 2.0
            await until(lambda: "before authentication announces a 67108864 B payload" in caplog.text)
        finally:
            channel.abort()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_server_stop_aborts_open_transfers_and_sender_reconnects(kind: str) -> None:
    async def scenario() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=8)
        server = await started(kind, receiver)
        sender = create_sender(config(kind), identity("prefill-0"))
        try:
            session = await sender.session(server.address, RequestId("r"))
            await session.open(block_hashes(2), 2, time.time() + 30)
            address = server.address
            await server.stop()
            assert [t for t, _ in receiver.aborts] == ["r"]
            await asyncio.sleep(0.2)
            with pytest.raises(TransferAborted, match="lost"):
                await session.complete(FirstToken(0))
            with pytest.raises(ConnectionLost):  # the dead connection is not reused: the sender dials again
                await sender.session(address, RequestId("r2"))
            server = await started(kind, receiver)
            await push(
                await sender.session(server.address, RequestId("r2")), random_cache(LAYOUT, 2, 5), [0, 1], []
            )
            audit(receiver, server, 8)
        finally:
            await sender.close()
            await server.stop()

    run(scenario())


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
        receiver = PagedReceiver(LAYOUT, num_blocks=16)
        server = await started(kind, receiver)
        proc = await spawn_sender(kind, server.address, "hang")
        try:
            assert proc.stdout is not None
            assert await proc.stdout.readline() == b"sent\n"
            await until(lambda: receiver.data_calls == 1)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await until(lambda: receiver.aborts)
            await asyncio.sleep(0.3)
            assert [t for t, _ in receiver.aborts] == ["xproc"]
            audit(receiver, server, 16)
        finally:
            if proc.returncode is None:
                proc.kill()
            await server.stop()

    run(scenario())
    gc.collect()  # a task whose exception nobody read reports it when collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_stopped_sender_is_cut_by_liveness_not_by_the_deadline(kind: str) -> None:
    """SIGSTOP of the sender mid-transfer (its deadline is a minute away): D hears no PING for its liveness
    window, cuts the connection, aborts the transfer once and says which peer went silent."""

    async def scenario() -> None:
        receiver = PagedReceiver(LAYOUT, num_blocks=16)
        server = await started(kind, receiver, liveness_s=1.0)
        proc = await spawn_sender(kind, server.address, "hang")
        try:
            assert proc.stdout is not None
            assert await proc.stdout.readline() == b"sent\n"
            await until(lambda: receiver.data_calls == 1)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await until(lambda: receiver.silent)
            assert time.monotonic() - stopped < 1.0 + 1.0  # the window, plus a ping interval's slack
            assert [t for t, _ in receiver.aborts] == ["xproc"]
            assert "silent" in receiver.aborts[0][1]
            assert [p for p, _ in receiver.silent] == ["prefill-proc"]
            audit(receiver, server, 16)
        finally:
            proc.kill()
            await proc.wait()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_an_idle_connection_stays_up_on_pings(kind: str) -> None:
    """Both ends ping at a quarter of the stricter window: a connection idle for several windows is not cut
    (neither end's window is the other's): D never hears silence and aborts nothing."""

    async def scenario() -> None:
        async with pair(kind, 8, sender_config={"liveness_s": 30.0}, liveness_s=0.4) as (
            receiver,
            server,
            sender,
        ):
            src = random_cache(LAYOUT, 4, seed=1)
            await push(await sender.session(server.address, RequestId("a")), src, [0, 1], [])
            await asyncio.sleep(2.0)
            await push(await sender.session(server.address, RequestId("b")), src, [2, 3], [])
            assert receiver.silent == [] and receiver.aborts == []

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
