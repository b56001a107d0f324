"""One-off probe harness (issue 21), put first on PYTHONPATH: PDSERVE_PROBE="gil=0.0005,window=2304,spin=0"
patches a node process before it starts (GIL switch interval, cuda_ipc window MiB, device_sync spin)."""

import os
import sys

_spec = os.environ.get("PDSERVE_PROBE", "")
if _spec:
    _kv = dict(item.split("=") for item in _spec.split(",") if item)
    if "gil" in _kv:
        sys.setswitchinterval(float(_kv["gil"]))
    if "window" in _kv:
        from pdserve.kvtransfer import connector as _c

        _c.CudaIpcOptions.__init__.__defaults__ = (int(_kv["window"]) << 20,)
    if "spin" in _kv:
        from pdserve.kvtransfer import device_sync as _d

        _d.SPIN_S = float(_kv["spin"])
