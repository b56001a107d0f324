"""The cuda_ipc connector: the window's placement rule everywhere, the connector itself on a GPU.

The GPU tests run D (a paged cache on the GPU) in this process and P as this file's script in a second
process (CUDA IPC memory cannot be opened by the process that exported it), on the first GPU or, with two,
the second one; the parts they share with the ucx GPU tests are in tests/harness/transfer_gpu.py. The window
is made small so that frames are split by layers, the ring wraps many times and
more frames than event slots are in flight over a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch
from pdserve.kvtransfer.common import ProtocolError
from pdserve.kvtransfer.connector import (
    KVReceiverServer,
    create_sender,
)
from pdserve.kvtransfer.cuda_ipc import CudaIpcOptions, live_windows
from pdserve.kvtransfer.cuda_ipc_setup import (
    RECORD_LEN,
    SETUP_CODEC,
    WindowAccept,
    WindowOffer,
    recv_record,
    send_record,
)
from pdserve.kvtransfer.tcp import TcpChannel, TcpTransport
from pdserve.kvtransfer.window_ring import ALIGN, SLOTS, WindowRing
from pdserve.shared.wire import WireError
from pdserve.tests.harness.transfer import audit, config, identity, run, until
from pdserve.tests.harness.transfer_gpu import (
    BLOCKS,
    GpuReceiver,
    aborted_once,
    check_landed,
    hang,
    kill_at_first_frame,
    push_numbered,
    serving,
    source_cache,
    spawn,
)

WINDOW = 4 * 1024  # bytes: one layer of 4 blocks is 1536 B, so a 3-layer frame is split and the ring wraps
TRANSFERS = 12  # x 3 frames = 36 frames > SLOTS


def test_ring_places_frames_in_order_and_wraps() -> None:
    ring = WindowRing(4096)
    assert ring.place(1000) == (0, 0, -1)
    assert ring.place(1000) == (1, 1024, -1)  # aligned up
    assert ring.place(1500) == (2, 2048, -1)
    # 3584 + 1000 > 4096: wraps to 0, over frame 0's bytes, which must be released first
    assert ring.place(1000) == (3, 0, 0)
    assert ring.place(100) == (4, 1024, 1)  # then over frame 1's
    assert ring.place(2000) == (5, 1536, 2)  # frames 1 and 2's: the newest of them counts
    assert ALIGN == 512


def test_ring_bounds_frames_in_flight_by_the_event_slots() -> None:
    ring = WindowRing(1 << 30)
    musts = [ring.place(ALIGN)[2] for _ in range(SLOTS + 3)]
    assert musts[:SLOTS] == [-1] * SLOTS
    assert musts[SLOTS:] == [0, 1, 2]  # frame k reuses frame k - SLOTS's event slots


def test_ring_undo_forgets_the_last_frame_and_refuses_oversized_ones() -> None:
    ring = WindowRing(4096)
    ring.place(3000)
    assert ring.place(2000) == (1, 0, 0)
    ring.undo()
    assert ring.place(500) == (1, 3072, -1)  # as if the 2000 B frame had never been placed
    with pytest.raises(ValueError, match="does not fit"):
        ring.place(4097)


def test_cuda_ipc_needs_a_gpu_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA"):
        create_sender(config("cuda_ipc", device="cpu"), identity("prefill-0"))


OFFER = WindowOffer(
    handle=b"h" * 64, size=1 << 20, offset=0, ref_counter=b"r" * 16, ref_counter_offset=8, event=b"",
    event_sync=False, freed=tuple(bytes([i]) * 64 for i in range(SLOTS)), progress=b"t" * 16,
)  # fmt: skip


def test_setup_records_round_trip_and_malformed_ones_are_refused_by_the_codec() -> None:
    assert SETUP_CODEC.from_msgpack(WindowOffer, SETUP_CODEC.to_msgpack(OFFER)) == OFFER
    accept = WindowAccept(OFFER.freed)
    assert SETUP_CODEC.from_msgpack(WindowAccept, SETUP_CODEC.to_msgpack(accept)) == accept
    fields = msgpack.unpackb(SETUP_CODEC.to_msgpack(OFFER))
    bad = [
        ({**fields, "freed": fields["freed"][1:]}, rf"WindowOffer: freed must hold {SLOTS} event"),
        ({**fields, "handle": "h" * 64}, r"WindowOffer.handle: expected bytes, got str"),
        ({**fields, "event_sync": 0}, r"WindowOffer.event_sync: expected bool, got int"),
        ({k: v for k, v in fields.items() if k != "progress"}, r"lacks field 'progress'"),
        ({**fields, "magic": "pdserve-cuda-ipc-1"}, r"unknown field\(s\) \['magic'\]"),  # the old record
        ({**fields, "v": fields["v"] - 1}, r"cuda_ipc setup record version"),
    ]
    for record, match in bad:
        with pytest.raises(WireError, match=match):
            SETUP_CODEC.from_msgpack(WindowOffer, msgpack.packb(record))
    with pytest.raises(WireError, match=r"WindowAccept: copied must hold"):
        SETUP_CODEC.from_msgpack(WindowAccept, msgpack.packb({"v": fields["v"], "copied": []}))


def test_setup_records_cross_a_real_connection_and_a_bad_one_is_a_protocol_error() -> None:
    """D's end reads records as `authenticated` does, over loopback TCP (no GPU needed for the records)."""

    async def scenario() -> None:
        accepted: asyncio.Queue[TcpChannel] = asyncio.Queue()

        async def on_channel(channel: object) -> None:
            assert isinstance(channel, TcpChannel)
            await accepted.put(channel)

        transport = TcpTransport()
        listener = await transport.listen("127.0.0.1", 0, on_channel)
        p = await transport.dial("127.0.0.1", listener.port, 5.0)
        assert isinstance(p, TcpChannel)
        d = await accepted.get()
        try:
            await send_record(d, OFFER)
            assert await recv_record(p, WindowOffer) == OFFER
            body = msgpack.packb({"v": SETUP_CODEC.version, "copied": [b"x"]})
            await p.send(RECORD_LEN.pack(len(body)), body, None)
            with pytest.raises(ProtocolError, match="bad cuda_ipc setup record") as refused:
                await recv_record(d, WindowAccept)
            assert isinstance(refused.value.__cause__, WireError)
            await p.send(RECORD_LEN.pack(1 << 20), b"", None)  # a length no record has
            with pytest.raises(ProtocolError, match="setup record of 1048576 B"):
                await recv_record(d, WindowAccept)
        finally:
            await p.close()
            await d.close()
            await listener.close()

    run(scenario())


async def _sender_process(address: str, mode: str, device: str) -> None:
    """P, as a script. full: TRANSFERS transfers; abort: one frame, then abort; hang: one frame, then wait
    to be killed. Prints its own audit once closed."""
    sender = create_sender(
        config("cuda_ipc", device=device, options=CudaIpcOptions(window_bytes=WINDOW)), identity("prefill-0")
    )
    src = source_cache(device)
    try:
        for t in range(TRANSFERS if mode == "full" else 1):
            session = await push_numbered(sender, address, src, "ipc", t, whole=mode == "full")
            if mode == "abort":
                await session.abort("client went away")
            elif mode == "hang":
                await hang()
    finally:
        await sender.close()
    print(json.dumps({"live_windows": live_windows()}), flush=True)


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[GpuReceiver, KVReceiverServer, str]]:
    """D's cuda_ipc server on the first GPU; yields (receiver, server, P's device); D holds no window
    afterwards."""
    async with serving("cuda_ipc", CudaIpcOptions(window_bytes=WINDOW)) as served:
        yield served
    await until(lambda: live_windows() == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a GPU")
def test_cuda_ipc_transfers_are_bit_identical_across_processes() -> None:
    async def scenario() -> None:
        async with _serving() as (receiver, server, p_device):
            proc = await spawn(__file__, server.address, "full", p_device)
            out, _ = await proc.communicate()
            assert proc.returncode == 0, out
            assert json.loads(out.decode().strip().splitlines()[-1]) == {"live_windows": 0}
            check_landed(receiver, "ipc", TRANSFERS)
            assert len(receiver.completed) == TRANSFERS
            # frames of 3 layers (4608 B) are split to fit the 4096 B window: 2 + 1 layers, then 1 layer
            assert receiver.data_calls == TRANSFERS * 3
            await until(lambda: not server.open_transfer_ids())
            audit(receiver, server, BLOCKS)

    run(scenario(), timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a GPU")
@pytest.mark.parametrize("mode", ["abort", "hang"])
def test_cuda_ipc_aborted_or_killed_sender_frees_the_reservation_once(mode: str) -> None:
    async def scenario() -> None:
        async with _serving() as (receiver, server, p_device):
            proc = await spawn(__file__, server.address, mode, p_device)
            if mode == "hang":
                await kill_at_first_frame(proc, receiver)
            out, _ = await proc.communicate()
            assert proc.returncode == (0 if mode == "abort" else -9), out
            await aborted_once(receiver, server, "ipc-0")

    run(scenario(), timeout=120)


if __name__ == "__main__":
    asyncio.run(_sender_process(*sys.argv[1:4]))
