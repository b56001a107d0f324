"""The pair-group transport (control over TCP, payloads over a 2-rank process group) on the CPU.

WHAT THIS IS: the nccl connector's code path — rendezvous record after the handshake, TCPStore hosted by D,
one group per connection, payload ordering, payload timeout, cut control connection, teardown — run with
torch.distributed's *gloo* backend standing in for NCCL (a test-only `GroupBackend`, in
tests/harness/gloo_pair.py), because this machine has no GPU. It is no claim that NCCL works: NCCL itself
(ProcessGroupNCCL, abort, GPU buffers) is exercised only by benchmarks/kv_transfer.py on two GPUs. The
protocol suite (tests/harness/transfer_suite.py) runs unchanged over the stand-in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from typing import Any

import pytest
import torch
from pdserve.kvtransfer import pair_group, sender
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import ConnectorConfig, connector_kinds, create_sender, register_connector
from pdserve.kvtransfer.doorbell import SHM_DIR
from pdserve.kvtransfer.framing import FramedConnection, encode_frame
from pdserve.kvtransfer.messages import Ack, Data, Message, Open, OpenOk
from pdserve.kvtransfer.pair_group import PairGroupChannel, PairGroupTransport, live_groups, wait_aborted
from pdserve.shared.types import RequestId
from pdserve.tests.harness import transfer
from pdserve.tests.harness.gloo_pair import KIND, GlooBackend, GlooPairGroup
from pdserve.tests.harness.transfer_suite import (
    CASE_IDS,
    CASES,
    Scenario,
    a_hello_announcing_a_payload_is_refused_from_its_prefix,
    an_idle_connection_stays_up_on_pings,
    run_case,
)

# The suite over the stand-in, less two cases that exercise nothing of the pair group: a HELLO refused
# before any group exists, and idle pings on the control connection (the tcp run covers both).
NOT_OVER_GLOO = {
    a_hello_announcing_a_payload_is_refused_from_its_prefix,
    an_idle_connection_stays_up_on_pings,
}


@pytest.mark.parametrize(
    ("scenario", "params"),
    [
        pytest.param(*case, id=i)
        for i, case in zip(CASE_IDS, CASES, strict=True)
        if case[0] not in NOT_OVER_GLOO
    ],
)
def test_protocol_suite_over_the_gloo_stand_in(
    scenario: Scenario, params: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    run_case(KIND, scenario, params, caplog)
    wait_aborted(5.0)
    assert live_groups() == 0, "a pair group outlived its connection"


def test_nccl_config_defaults_and_device_check() -> None:
    assert ConnectorConfig(kind="nccl", auth_token="t").frame_checksum is False
    assert ConnectorConfig(kind="nccl", auth_token="t", checksum=True).frame_checksum is True
    assert ConnectorConfig(kind="tcp", auth_token="t").frame_checksum is True
    assert ConnectorConfig(kind="tcp", auth_token="t", device="cuda:0").frame_checksum is True
    assert ConnectorConfig(kind="ucx", auth_token="t").frame_checksum is True  # host memory
    assert ConnectorConfig(kind="ucx", auth_token="t", device="cuda:0").frame_checksum is False
    with pytest.raises(ValueError, match=re.escape("CUDA ConnectorConfig.device, got 'cpu'")):
        create_sender(ConnectorConfig(kind="nccl", auth_token="t"), transfer.identity("p"))
    with pytest.raises(ValueError, match="'tpu:0'"):
        ConnectorConfig(kind="tcp", auth_token="t", device="tpu:0")


async def _open_with_header_only(server: Any, cut: bool) -> tuple[Any, PairGroupChannel]:
    """A raw sender that announces a DATA payload on the control connection but never sends it."""
    conn = await transfer.raw_sender(KIND, server)
    channel = conn.channel
    assert isinstance(channel, PairGroupChannel) and channel.has_group
    await conn.send(Open(RequestId("stuck"), (), 2, time.time() + 30))
    reply = (await conn.recv()).msg
    assert isinstance(reply, OpenOk)
    msg, payload = transfer.data_frame("stuck", reply)
    prefix, header, _ = encode_frame(msg, payload, checksum=True)
    await channel._control.send(prefix, header, None)
    if cut:
        channel._control.abort()
    return conn, channel


@pytest.mark.parametrize("cut", [True, False], ids=["peer-gone", "payload-timeout"])
def test_announced_payload_that_never_comes_aborts_the_pair(
    cut: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """D waits in a payload recv: the control connection closing, or the liveness window, ends it."""
    caplog.set_level(logging.WARNING, logger="pdserve.kvtransfer")

    async def scenario() -> None:
        receiver = transfer.PagedReceiver(transfer.LAYOUT, num_blocks=8)
        server = await transfer.started(KIND, receiver, liveness_s=0.5)
        try:
            t0 = time.monotonic()
            conn, channel = await _open_with_header_only(server, cut)
            await transfer.until(lambda: receiver.aborts, timeout=5.0)
            waited = time.monotonic() - t0
            assert [t for t, _ in receiver.aborts] == ["stuck"]
            assert "connection" in receiver.aborts[0][1]
            # no payload within the window: the payload wait or the silence (no PING read meanwhile) ends it
            expected = ["control connection closed"] if cut else ["not done within 0.5s", "silent for"]
            assert any(e in caplog.text for e in expected), caplog.text
            assert waited < (1.0 if cut else 2.0), waited
            channel.abort()
            with pytest.raises(ConnectionLost):
                await conn.send(Data("stuck", 0, 1, (0,), (0,), (0,)), torch.zeros(8, dtype=torch.uint8))
            transfer.audit(receiver, server, 8)
        finally:
            await server.stop()
        await transfer.until(lambda: live_groups() == 0)

    transfer.run(scenario())


def test_many_payload_frames_keep_their_order() -> None:
    """Per-layer frames of different sizes land in the right layers (the n-th send meets the n-th recv)."""

    async def scenario() -> None:
        async with transfer.pair(KIND, 16) as (receiver, server, sender):
            src = transfer.random_cache(transfer.LAYOUT, 12, seed=4)
            session = await sender.session(server.address, RequestId("order"))
            reply, stats = await transfer.push(
                session, src, [3, 1, 4, 1 + 9, 5, 9, 2], [], layers_per_frame=1
            )
            for j, b in enumerate(reply.dst_block_ids):
                assert torch.equal(receiver.kv[:, :, b], src[:, :, [3, 1, 4, 10, 5, 9, 2][j]])
            assert stats.payload_bytes == transfer.LAYOUT.num_layers * 7 * transfer.LAYOUT.layer_block_bytes
            transfer.audit(receiver, server, 16)
        await asyncio.to_thread(wait_aborted, 5.0)
        assert live_groups() == 0

    transfer.run(scenario())


ABORT_S = 0.5  # how long ncclCommAbort took on two H200s
SLOW_KIND = "gloo-pair-slow-abort"


class SlowAbortGlooPairGroup(GlooPairGroup):
    def abort(self) -> None:
        time.sleep(ABORT_S)  # like ncclCommAbort: blocks its caller, holds no lock the loop needs
        super().abort()


class SlowAbortGlooBackend(GlooBackend):
    group_type = SlowAbortGlooPairGroup


if SLOW_KIND not in connector_kinds():
    register_connector(
        SLOW_KIND,
        ChannelConnector(
            lambda cfg: PairGroupTransport(SLOW_KIND, SlowAbortGlooBackend(), cfg), checksum_default=False
        ),
    )


def test_group_teardown_does_not_stall_the_event_loop() -> None:
    """Tearing a pair down (here: the sender closes, then D stops) runs each group's slow abort in a
    thread: the event loop keeps ticking, `live_groups` counts a group until its abort returned, and
    `close` returns only after it."""

    async def scenario() -> None:
        receiver = transfer.PagedReceiver(transfer.LAYOUT, num_blocks=8)
        server = await transfer.started(SLOW_KIND, receiver)
        sender = create_sender(transfer.config(SLOW_KIND), transfer.identity("prefill-0"))
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        try:
            session = await sender.session(server.address, RequestId("one"))
            await transfer.push(session, transfer.random_cache(transfer.LAYOUT, 4, seed=2), [1, 3], [])
            gaps.clear()
            t0 = time.monotonic()
            # P's group: its abort runs in a thread and close waits for it; D sees the connection end and
            # aborts its group in a thread too. Both are counted until their aborts returned.
            closing = asyncio.ensure_future(sender.close())
            await transfer.until(lambda: live_groups() == 2, timeout=ABORT_S * 0.8)
            await closing
            assert time.monotonic() - t0 >= ABORT_S
            await asyncio.to_thread(wait_aborted, 5.0)
            assert live_groups() == 0
            assert max(gaps) < ABORT_S / 2, f"the event loop stalled for {max(gaps):.3f} s"
            transfer.audit(receiver, server, 8)
        finally:
            ticker.cancel()
            await sender.close()
            await server.stop()

    transfer.run(scenario())


def _doorbell_files() -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(pair_group.DOORBELL_PREFIX)]


async def _one_transfer(tid: str) -> None:
    """One 2-block transfer over the gloo pair, checked block for block and audited on both ends."""
    async with transfer.pair(KIND, 8) as (receiver, server, kv_sender):
        src = transfer.random_cache(transfer.LAYOUT, 4, seed=5)
        session = await kv_sender.session(server.address, RequestId(tid))
        reply, _ = await transfer.push(session, src, [2, 0], [])
        assert not _doorbell_files(), "D unlinks the doorbell's file once the pair is set up"
        for j, b in enumerate(reply.dst_block_ids):
            assert torch.equal(receiver.kv[:, :, b], src[:, :, [2, 0][j]])
        transfer.audit(receiver, server, 8)
    await asyncio.to_thread(wait_aborted, 5.0)
    assert live_groups() == 0 and not _doorbell_files()


def test_the_doorbell_completes_a_transfer_whose_ack_frame_never_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On one host P takes the ACK from D's doorbell: D's ACK frames are dropped here, and P (spinning
    long enough for a slow machine) still completes."""
    send = FramedConnection.send

    async def send_all_but_acks(
        self: FramedConnection, msg: Message, payload: torch.Tensor | None = None
    ) -> None:
        if not isinstance(msg, Ack):
            await send(self, msg, payload)

    monkeypatch.setattr(FramedConnection, "send", send_all_but_acks)
    monkeypatch.setattr(sender, "SPIN_S", 30.0)
    transfer.run(_one_transfer("rung"))


@pytest.mark.parametrize("where", ["d-has-no-shm", "p-on-another-host", "p-may-not-open"])
def test_without_a_doorbell_the_ack_frame_completes(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "d-has-no-shm":

        def no_shm(*args: Any) -> Any:
            raise OSError("no /dev/shm")

        monkeypatch.setattr(pair_group, "SharedFile", no_shm)
    elif where == "p-on-another-host":
        monkeypatch.setattr(pair_group, "open_shared", lambda *args: None)
    else:

        def denied(*args: Any) -> Any:
            raise PermissionError("D's file belongs to another user")

        monkeypatch.setattr(pair_group, "open_shared", denied)
    caplog.set_level(logging.WARNING, logger="pdserve.kvtransfer")
    transfer.run(_one_transfer(where))
    assert ("no ACK doorbell" in caplog.text) == (where != "p-on-another-host")
