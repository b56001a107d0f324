"""Connectors own their options: each kind's config is built, checked and read (its options, its checksum
default) from the connector's own module, without the connector's optional library (ucxx) installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a subprocess

SCRIPT = """
import sys
sys.modules["ucxx"] = None  # as without the [ucx] extra: `import ucxx` raises ModuleNotFoundError
from pdserve.kvtransfer.connector import ConnectorConfig, KVTransferError, connector_kinds, create_sender
from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.cuda_ipc import CudaIpcOptions
from pdserve.kvtransfer.ucx import UcxOptions
from pdserve.shared.types import KVLayout, NodeId

options = {"ucx": UcxOptions(window_bytes=1 << 20), "cuda_ipc": CudaIpcOptions(window_bytes=1 << 20)}
for kind in connector_kinds():
    for device in ("cpu", "cuda:0"):
        for opts in (None, options.get(kind)):
            config = ConnectorConfig(kind=kind, auth_token="t", device=device, options=opts)
            print(kind, device, config.frame_checksum)
try:
    ConnectorConfig(kind="tcp", auth_token="t", options=UcxOptions())
except ValueError as exc:
    print("refused:", exc)
layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="bfloat16")
try:
    create_sender(ConnectorConfig(kind="ucx", auth_token="t"), PeerIdentity(NodeId("p"), bytes(32), layout))
except KVTransferError as exc:
    print("ucx end:", exc)
print("ucxx imported:", sys.modules["ucxx"] is not None)
"""


def test_every_connector_config_is_read_without_its_optional_library() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    checksums = {tuple(line.split()) for line in lines[:16]}
    assert checksums == {
        ("cuda_ipc", "cpu", "False"),
        ("cuda_ipc", "cuda:0", "False"),
        ("nccl", "cpu", "False"),
        ("nccl", "cuda:0", "False"),
        ("tcp", "cpu", "True"),
        ("tcp", "cuda:0", "True"),
        ("ucx", "cpu", "True"),
        ("ucx", "cuda:0", "False"),
    }
    assert lines[16] == "refused: ConnectorConfig.options UcxOptions do not fit kind 'tcp' (it takes none)"
    assert lines[17] == (
        "ucx end: the ucx connector needs ucxx, which is not installed: pip install 'pdserve[ucx]'"
    )
    assert lines[18] == "ucxx imported: False"
