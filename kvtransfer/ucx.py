"""The UCX connector: its own settings (`UcxOptions`), its checksum default, and its transport
(ucx_transport.py), imported only when a ucx end is built. Invariant: importing this module (which reading or
checking a configuration naming ucx does) never imports ucxx, an optional library (the `ucx` extra).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import KVTransferError
from pdserve.kvtransfer.connector import ConnectorConfig, ConnectorOptions
from pdserve.kvtransfer.transport import Transport

UCX_PROGRESS_MODES = ("auto", "thread", "thread-polling")


@dataclass(frozen=True)
class UcxOptions(ConnectorOptions):
    """The ucx connector's own settings."""

    # D's standing receive per connection, on `ConnectorConfig.device`: payloads up to this size land in it
    # through a receive D posted before they were sent.
    window_bytes: int = 512 << 20
    # How UCX progresses its requests (one UCX context per process: the first ucx transport's setting holds).
    # "thread-polling": a progress thread busy-polls UCX (one core per node) and sees a payload land at once;
    # "thread": it sleeps until UCX wakes it (slower to see a payload land: docs/kv_transfer_protocol.md);
    # "auto": thread-polling on a GPU `device`, thread on host memory.
    progress: str = "auto"

    def __post_init__(self) -> None:
        if self.window_bytes <= 0:
            raise ValueError(f"UcxOptions.window_bytes must be > 0, got {self.window_bytes}")
        if self.progress not in UCX_PROGRESS_MODES:
            raise ValueError(f"UcxOptions.progress {self.progress!r} must be one of {UCX_PROGRESS_MODES}")


def _transport(config: ConnectorConfig) -> Transport:
    try:
        module = importlib.import_module("pdserve.kvtransfer.ucx_transport")
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("pdserve"):
            raise
        raise KVTransferError(
            f"the ucx connector needs {exc.name}, which is not installed: pip install 'pdserve[ucx]'"
        ) from exc
    transport: Transport = module.UcxTransport(config)
    return transport


def _checksum_default(config: ConnectorConfig) -> bool:
    """On over host memory (TCP, shared memory); off when payloads are GPU memory (cuda_ipc over NVLink,
    RDMA), whose links check integrity, and where a CRC would copy each payload to the host first."""
    return torch.device(config.device).type != "cuda"


CONNECTOR = ChannelConnector(_transport, checksum_default=_checksum_default, options=UcxOptions)
