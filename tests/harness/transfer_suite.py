"""The KV-transfer protocol suite: connector-independent scenarios, each run unchanged over every connector
kind (the protocol tests run them over tcp and ucx, the pair-group tests over the gloo stand-in of the nccl
connector's pair group). A scenario is a coroutine over a connector `kind` and
its case's parameters; CASES lists every case, and run_case runs one under the harness's timeout. Every
scenario ends by auditing that D's blocks are back where they started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

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
from pdserve.kvtransfer.framing import PREFIX, PREFIX_SIZE, FramedConnection, encode_frame
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
from pdserve.kvtransfer.transport import parse_address
from pdserve.shared.types import FirstToken, RequestId
from pdserve.tests.harness.transfer import (
    LAYOUT,
    TOKEN,
    TRANSPORTS,
    PagedReceiver,
    audit,
    block_hashes,
    config,
    data_frame,
    identity,
    pair,
    push,
    random_cache,
    raw_sender,
    run,
    started,
    until,
)


async def full_transfer_is_bit_identical(kind: str, checksum: bool) -> None:
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


async def sessions_are_multiplexed_on_one_connection(kind: str) -> None:
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


async def wrong_token_is_refused(kind: str, wrong_side: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")
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


async def receiver_checks_the_senders_proof(kind: str) -> None:
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


async def incompatible_peer_is_refused_naming_the_field(
    kind: str, change: dict[str, Any], code: str, named: str
) -> None:
    async with pair(kind, 4, sender_identity=identity("prefill-0", **change)) as (
        receiver,
        server,
        sender,
    ):
        with pytest.raises(HandshakeError) as err:
            await sender.session(server.address, RequestId("r"))
        assert err.value.code == code and named in str(err.value)
        audit(receiver, server, 4)


async def ends_of_other_tensor_parallel_sizes_exchange_blocks(kind: str) -> None:
    """Frames carry every KV head whatever either end's size: the handshake states tp_size only."""
    p3 = identity("prefill-0", layout=dataclasses.replace(LAYOUT, tp_size=3))
    async with pair(kind, 8, sender_identity=p3) as (receiver, server, sender):
        src = random_cache(LAYOUT, 4, seed=2)
        session = await sender.session(server.address, RequestId("r"))
        reply, _ = await push(session, src, [1, 3], block_hashes(1), layers_per_frame=2)
        for j, b in enumerate([1, 3]):
            assert torch.equal(receiver.kv[:, :, reply.dst_block_ids[j]], src[:, :, b])
        audit(receiver, server, 8)


async def sender_abort_frees_the_reservation(kind: str) -> None:
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


async def open_refusal_reserves_nothing(kind: str) -> None:
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


async def receiver_aborts_at_the_deadline(kind: str) -> None:
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


async def connection_cut_midway_aborts_exactly_once(kind: str) -> None:
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


async def corrupted_frame_aborts_that_transfer(kind: str, caplog: pytest.LogCaptureFixture) -> None:
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
        await conn.send(Open(RequestId("next"), (), 1, time.time() + 30))  # the connection itself survives
        assert isinstance((await conn.recv()).msg, OpenOk)
        await conn.send(Abort("next", "done"))
        await until(lambda: len(receiver.aborts) == 2)
        audit(receiver, server, 8)
    finally:
        conn.channel.abort()
        await server.stop()


async def other_protocol_version_is_refused(kind: str) -> None:
    FUTURE = PROTOCOL_VERSION + 1
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


async def a_hello_announcing_a_payload_is_refused_from_its_prefix(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before authentication no frame may carry a payload: a HELLO announcing 64 MiB is refused once its
    24-byte prefix is read. The peer sends the prefix and header only, never the 64 MiB; D still hangs up
    at once, long before its 10 s handshake timeout (it used to wait to read the payload in full)."""
    caplog.set_level(logging.INFO, logger="pdserve.kvtransfer")
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


async def server_stop_aborts_open_transfers_and_sender_reconnects(kind: str) -> None:
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


async def an_idle_connection_stays_up_on_pings(kind: str) -> None:
    """Both ends ping at a quarter of the stricter window: a connection idle for several windows is not cut
    (neither end's window is the other's): D never hears silence and aborts nothing."""
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


Scenario = Callable[..., Coroutine[Any, Any, None]]
CASES: list[tuple[Scenario, dict[str, Any]]] = [
    (full_transfer_is_bit_identical, {"checksum": True}),
    (full_transfer_is_bit_identical, {"checksum": False}),
    (sessions_are_multiplexed_on_one_connection, {}),
    (wrong_token_is_refused, {"wrong_side": "sender"}),
    (wrong_token_is_refused, {"wrong_side": "receiver"}),
    (receiver_checks_the_senders_proof, {}),
    *(
        (incompatible_peer_is_refused_naming_the_field, {"change": change, "code": code, "named": named})
        for change, code, named in [
            ({"fingerprint": b"\x22" * 32}, "fingerprint", "fingerprint"),
            ({"layout": KVLayout(4, 3, 8, 16, "bfloat16")}, "layout", "block_size"),
            ({"layout": KVLayout(4, 3, 8, 4, "float16")}, "layout", "dtype"),
            ({"layout": KVLayout(4, 1, 8, 4, "bfloat16", tp_size=3)}, "layout", "num_kv_heads"),
        ]
    ),
    (ends_of_other_tensor_parallel_sizes_exchange_blocks, {}),
    (sender_abort_frees_the_reservation, {}),
    (open_refusal_reserves_nothing, {}),
    (receiver_aborts_at_the_deadline, {}),
    (connection_cut_midway_aborts_exactly_once, {}),
    (corrupted_frame_aborts_that_transfer, {}),
    (other_protocol_version_is_refused, {}),
    (a_hello_announcing_a_payload_is_refused_from_its_prefix, {}),
    (server_stop_aborts_open_transfers_and_sender_reconnects, {}),
    (an_idle_connection_stays_up_on_pings, {}),
]
"""Every case of the suite: a scenario and the parameters it runs with (besides the connector kind)."""
CASE_IDS = [
    "-".join([s.__name__, *(str(v) for k, v in params.items() if k != "change")]) for s, params in CASES
]


def run_case(kind: str, scenario: Scenario, params: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Runs one case over connector `kind`; a scenario that reads the log gets the test's caplog."""
    if "caplog" in inspect.signature(scenario).parameters:
        params = {**params, "caplog": caplog}
    run(scenario(kind, **params))
