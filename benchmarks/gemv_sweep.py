"""Tile sweep for kernels/triton_gemv.py on the 8B layer shapes, beside cuBLAS (`F.linear`), on one GPU.

    python benchmarks/gemv_sweep.py [--rows 1 16]

Prints, per (shape, rows), cuBLAS's time and bandwidth and the best Triton configs; the defaults in
`triton_gemv.default_config` come from its output (recorded in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing
from pdserve.benchmarks.gpu_decode import copy_bandwidth
from pdserve.kernels.triton_gemv import GemvConfig, default_config, gemv

GIB = 1 << 30
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # fmt: skip


def ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / GIB:.0f} GiB/s")
    for rows in args.rows:
        grid = (
            itertools.product([2, 4, 8], [1024, 2048, 4096], [4, 8, 16], [2, 3])
            if rows == 1
            else itertools.product([16, 32, 64], [64, 128, 256], [4, 8], [2, 3])
        )
        configs = [GemvConfig(*c) for c in grid]
        for name, (n, k) in SHAPES.items():
            sweep_shape(name, n, k, rows, configs, bw, dev)


def sweep_shape(
    name: str, n: int, k: int, rows: int, configs: list[GemvConfig], bw: float, dev: torch.device
) -> None:
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float())
    nbytes = w.numel() * 2

    def share(seconds_ms: float) -> str:
        return f"{seconds_ms * 1e3:6.1f} us ({nbytes / seconds_ms / 1e-3 / bw:.0%} of copy)"

    t_blas = ms(lambda: F.linear(x, w))
    results = []
    for cfg in configs:
        err = float((gemv(x, w, None, cfg).float() - want).abs().max())
        results.append((ms(functools.partial(gemv, x, w, None, cfg)), cfg, err))
    results.sort(key=lambda r: r[0])
    t_def = ms(lambda: gemv(x, w, None))
    print(f"rows={rows} {name:8s} {n}x{k}: cuBLAS {share(t_blas)}, "
          f"default {default_config(n, k, rows)} {share(t_def)}")  # fmt: skip
    for t, cfg, err in results[:4]:
        print(f"    {share(t)}  {cfg}  max err {err:.3g}")


if __name__ == "__main__":
    main()
