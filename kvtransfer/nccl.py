"""The NCCL connector: the protocol's frames over TCP, DATA payloads over a NCCL communicator per P-D pair.

The pair's group is a `ProcessGroupNCCL` (world size 2: D rank 0, P rank 1) on a PrefixStore over a
TCPStore that D hosts for that connection (pair_group.py has the setup and teardown). Payloads are GPU
memory on `ConnectorConfig.device` (host buffers are staged onto it); frames are not checksummed unless the
config asks (NVLink and InfiniBand check integrity in hardware).

Cut and hung transfers: PyTorch's NCCL watchdog ends the whole process on a timed-out op (its default
error handling), so its timeout is set beyond the channel's own: each payload op is polled with
`Work.is_completed()` from asyncio (spinning briefly, then sleeping up to 1 ms), and on failure,
cancellation, the liveness window (`liveness_s`), or the control connection closing, the channel calls
`ProcessGroupNCCL.abort()` (ncclCommAbort on the pair's communicators), which ends the op's kernels and
returns without killing the process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.pair_group import PairGroupTransport
from pdserve.kvtransfer.transport import Transport


class _PointToPoint(Protocol):
    """What the channel uses of a ProcessGroupNCCL (a c10d Backend; its stubs lack send/recv)."""

    def rank(self) -> int: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...

    def abort(self) -> None: ...


class NcclPairGroup:
    def __init__(self, group: _PointToPoint) -> None:
        self._group = group
        self._peer = 1 - group.rank()

    def send(self, tensor: torch.Tensor) -> dist.Work:
        return self._group.send([tensor], self._peer, 0)

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        return self._group.recv([tensor], self._peer, 0)

    def done(self, work: dist.Work) -> bool:
        if not work.is_completed():
            return False
        work.wait()  # raises if the op failed; the op is done, so this blocks nothing
        return True

    def order_after(self, work: dist.Work) -> None:
        work.wait()  # ProcessGroupNCCL: the current stream waits for the op's end event; the host does not

    def abort(self) -> None:
        self._group.abort()


class NcclBackend:
    name = "nccl"

    def connect(self, store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> NcclPairGroup:
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        with torch.cuda.device(device):
            group: _PointToPoint = ProcessGroupNCCL(store, rank, 2, options)  # type: ignore[assignment]
            return NcclPairGroup(group)


def _transport(config: ConnectorConfig) -> Transport:
    if torch.device(config.device).type != "cuda":
        raise ValueError(f"the nccl connector needs a CUDA ConnectorConfig.device, got {config.device!r}")
    return PairGroupTransport("nccl", NcclBackend(), config)


CONNECTOR = ChannelConnector(_transport, checksum_default=False)
