"""A test-only connector kind, "gloo-pair": the pair-group transport (the nccl connector's code path) with
torch.distributed's gloo backend standing in for NCCL, on the CPU. Importing this module registers it, and
the transfer scenarios' raw sender (tests/harness/transfer.py's TRANSPORTS) learns to dial it."""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.connector import connector_kinds, register_connector
from pdserve.kvtransfer.pair_group import PairGroupTransport
from pdserve.tests.harness import transfer
from torch._C._distributed_c10d import ProcessGroupGloo

KIND = "gloo-pair"  # test-only connector kind: the pair-group transport over gloo
GLOO_TIMEOUT_S = 3.0  # bounds a gloo wait the channel gave up on (gloo has no abort that ends it)


class GlooPairGroup:
    """Test-only stand-in for NcclPairGroup: gloo's p2p `is_completed` only turns true inside `wait`, so a
    worker thread waits and `done` reports on it."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._peer = 1 - group.rank()
        self._waits: dict[int, concurrent.futures.Future[Any]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def send(self, tensor: torch.Tensor) -> dist.Work:
        return self._group.send([tensor], self._peer, 0)

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        return self._group.recv([tensor], self._peer, 0)

    def done(self, work: dist.Work) -> bool:
        waiting = self._waits.get(id(work))
        if waiting is None:
            waiting = self._waits[id(work)] = self._pool.submit(work.wait)
        if not waiting.done():
            return False
        del self._waits[id(work)]
        waiting.result()  # gloo raises RuntimeError on failure
        return True

    def order_after(self, work: dist.Work) -> None:
        raise AssertionError("host-memory pairs wait for their payloads on the host")

    def abort(self) -> None:
        self._group.abort()
        self._pool.shutdown(wait=False)


class GlooBackend:
    name = "gloo"
    group_type: type[GlooPairGroup] = GlooPairGroup

    def connect(self, store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> GlooPairGroup:
        assert device.type == "cpu", device
        return self.group_type(ProcessGroupGloo(store, rank, 2, timedelta(seconds=GLOO_TIMEOUT_S)))


if KIND not in connector_kinds():
    register_connector(
        KIND,
        ChannelConnector(lambda cfg: PairGroupTransport(KIND, GlooBackend(), cfg), checksum_default=False),
    )
transfer.TRANSPORTS[KIND] = lambda: PairGroupTransport(KIND, GlooBackend(), transfer.config(KIND))
