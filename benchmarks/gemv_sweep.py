"""Tiles for the decode GEMV (kernels/triton_gemv.py) per shape on this GPU, against cuBLAS and the copy
bandwidth in the same run. Prints one markdown table per weight shape; writes the full results as JSON and,
with `--table-out`, the config table kernels/gemv_configs.py reads (the committed one with this device's
measured entries replaced), ready to copy over kernels/gemv_configs.json.

    python benchmarks/gemv_sweep.py --budget-s 200 --out gemv_sweep.json --table-out gemv_configs.json

Shapes: the decode products (QKV, O, gate+up fused as the model holds them, down, LM head) of
Llama-3.1-8B at TP=1 and TP=2 and Llama-3.1-70B at TP=2 (`--models` picks others: a mixture of experts
such as qwen3-30b-a3b has QKV, O, its router and the LM head here, its experts being
kernels/triton_moe_decode.py's), one rank's shard
(shared/model/parallel.py), at M = 1 (a fine grid; FP8 weights: tiles of up to twice the elements, the
same bytes), then M = 4 and 16 (a coarse one), and with `--rows` 32 or 64 (batched decode) a coarse grid of
wider tiles. gate+up is timed as the model runs it, with SiLU x up in
the GEMV's epilogue (kernels/triton_gemv.py's `gemv_silu_mul`), and checked against silu(gate) * up.
Each candidate (block_n, block_k, num_warps, num_stages, split_k; FP8 at one row: narrow_w on the best six;
prefetch, the first weight tile asked of L2 before the programmatic launch's wait, on the best three), the
launcher's current choice first (the table's or the heuristic's: "current µs"), is checked against torch in
fp32 (max error <= 2^-6 of the largest output) and timed as a CUDA graph of back-to-back launches that rotate
over enough copies of the weight to exceed the L2 cache several times, so every launch reads its weight from
HBM, as decode does. cuBLAS (`F.linear`) is timed the same way. Bytes: weight (+ FP8 scales) + x + y. The copy
bandwidth counts bytes read plus written (as benchmarks/gpu_decode.py). A config that fails to compile, run or
verify prints one line and is skipped; once `--budget-s` is spent the sweep stops and still prints and writes
what it has. Up to 16 rows the GEMV always runs, so the best tile is written; above 16 the model runs the GEMV
only where the table holds an entry (kernels/triton_gemv.py's `runs_gemv`), so one is written only where the
best tile beat cuBLAS, and this device's entry for a bucket where cuBLAS won is removed. Kernels are compiled
once for all shapes first (compilation depends on the tiles, not on N or K), so the budget left is shared
fairly between the shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pdserve.benchmarks.gpu_decode import graph_us
from pdserve.kernels.gemv_configs import (
    GEMV_ROWS,
    M_BUCKETS,
    TABLE_PATH,
    GemvConfig,
    TableKey,
    load_table,
    m_bucket,
    parse_table,
    table_document,
)
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.model.parallel import plan

GIB = 1 << 30
MODELS = (("llama-3.1-8b", 1), ("llama-3.1-8b", 2), ("llama-3.1-70b", 2))
TOL = 2.0**-6  # max |y - ref| / max |ref|: bf16 output rounding is 2^-9
LAUNCHES = 24  # per timed graph: enough that one replay is far above the event resolution
REPLAYS = 3  # timed replays of the graph; the median is kept


@dataclass(frozen=True)
class Shape:
    model: str
    tp: int
    name: str  # qkv, o, gate_up, down (or a mixture of experts' router), lm_head
    n: int
    k: int

    @property
    def label(self) -> str:
        return f"{self.model} TP={self.tp} {self.name} [N={self.n}, K={self.k}]"


@dataclass
class Result:
    shape: Shape
    rows: int
    tried: list[dict[str, Any]] = field(default_factory=list)  # config, us, or error
    cublas_us: float | None = None

    def timed(self) -> list[dict[str, Any]]:
        return [t for t in self.tried if "us" in t]

    def best(self) -> dict[str, Any] | None:
        return min(self.timed(), key=lambda t: t["us"], default=None)


def decode_shapes(models: Iterable[tuple[str, int]] = MODELS) -> list[Shape]:
    """The GEMV shapes of one decode layer plus the LM head, per (model, TP) of `models`, one rank's shard."""
    shapes = []
    for model, tp in models:
        c = NAMED_SHAPES[model]
        p = plan(c, 0, tp)
        attention = (("qkv", p.qkv_size, c.hidden_size), ("o", c.hidden_size, p.num_heads * p.head_dim))
        # a mixture of experts' experts are kernels/triton_moe_decode.py's; its router is this GEMV
        mlp = (("router", c.moe.num_experts, c.hidden_size),) if c.moe is not None else (
            ("gate_up", 2 * p.intermediate_size, c.hidden_size), ("down", c.hidden_size, p.intermediate_size)
        )  # fmt: skip
        for name, n, k in (*attention, *mlp, ("lm_head", p.vocab_rows, c.hidden_size)):
            shapes.append(Shape(model, tp, name, n, k))
    return shapes


def base_grid(rows: int, fp8: bool = False) -> list[GemvConfig]:
    """Unsplit candidates. One row: tiles of 2k-16k weight elements per step (FP8: up to 32k, the same
    bytes), 4 or 8 warps. Several rows (tl.dot): a coarse set of tiles at 3 stages."""
    if rows == 1:
        most = 32768 if fp8 else 16384
        tiles = [(bn, bk) for bn, bk in itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096, 8192))
                 if 2048 <= bn * bk <= most and bk <= (8192 if fp8 else 4096)]  # fmt: skip
        return [GemvConfig(bn, bk, w, 2) for (bn, bk), w in itertools.product(tiles, (4, 8))]
    if rows <= GEMV_ROWS:
        tiles = [(16, 256), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256)]
        return [GemvConfig(bn, bk, 4, 3) for bn, bk in tiles]
    # 32 or 64 rows: x's tile is as large as W's, so more output columns a program share its reads
    tiles = [(32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]
    return [GemvConfig(bn, bk, 4, 3) for bn, bk in tiles] + [GemvConfig(128, 128, 8, 3)]


def refinements(best: list[GemvConfig], rows: int) -> list[GemvConfig]:
    """Split-K for the best few unsplit tiles, then other stage counts for the very best."""
    splits = (2, 4) if rows == 1 else (2, 4, 8)
    out = [replace(c, split_k=s) for c in best[: 4 if rows == 1 else 2] for s in splits]
    out += [replace(best[0], num_stages=s) for s in (1, 3, 4) if s != best[0].num_stages] if best else []
    return out


def with_narrow(ranked: list[GemvConfig], rows: int, fp8: bool) -> list[GemvConfig]:
    """FP8 at one row: 8-element weight loads (x's layout) for the best six configs measured."""
    return [replace(c, narrow_w=True) for c in ranked[:6] if not c.narrow_w] if fp8 and rows == 1 else []


def with_prefetch(ranked: list[GemvConfig]) -> list[GemvConfig]:
    """The first weight tile prefetched before the grid dependency wait, for the best three configs measured,
    split or not."""
    return [replace(c, prefetch=True) for c in ranked[:3] if not c.prefetch]


def log(msg: str) -> None:
    print(f"[gemv_sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    """Timing and checking on one device; owns the weight copies of the shape being swept."""

    def __init__(self, dev: torch.device, weight: str) -> None:
        from pdserve.kernels.triton_gemv import choose_config, gemv, gemv_silu_mul

        self.dev, self.fp8 = dev, weight == "fp8"
        self.gemv, self.gemv_silu_mul, self.choose_config = gemv, gemv_silu_mul, choose_config
        props = torch.cuda.get_device_properties(dev)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
        # its own generator: a capture that fails leaves the default one registered to that graph
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(0)

    def copy_bandwidth(self) -> float:
        """Bytes/s of a device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
        import triton.testing

        src = torch.empty(GIB, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=300, return_mode="median")
        return 2 * src.numel() / (ms / 1e3)

    def weights(self, n: int, k: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Copies of an [N, K] weight (the first and the rest equal) totalling >= 4x the L2 cache; FP8 with
        one row scale."""
        per = n * k * (1 if self.fp8 else 2)
        copies = max(1, min(16, math.ceil(4 * self.l2_bytes / per)))
        w = torch.randn(n, k, device=self.dev, generator=self.gen) * 0.05
        if self.fp8:
            scale = torch.rand(n, device=self.dev, generator=self.gen) * 1e-3 + 1e-4
            q = (w / scale[:, None] * 1e-2).clamp(-448, 448).to(torch.float8_e4m3fn)
            return [q] + [q.clone() for _ in range(copies - 1)], scale
        wb = w.to(torch.bfloat16)
        return [wb] + [wb.clone() for _ in range(copies - 1)], None

    def sweep_shape(
        self, shape: Shape, rows: int, configs: Iterable[GemvConfig], deadline: float, res: Result
    ) -> None:
        ws, scale = self.weights(shape.n, shape.k)
        x = torch.randn(rows, shape.k, device=self.dev, generator=self.gen).to(torch.bfloat16)
        w_ref = ws[0].float() * (scale[:, None] if scale is not None else 1.0)
        ref = x.float() @ w_ref.T
        del w_ref
        glu = shape.name == "gate_up"  # the model runs gate+up with SiLU x up fused: time that kernel
        if glu:
            ref = F.silu(ref[:, : shape.n // 2]) * ref[:, shape.n // 2 :]
        ref_max = ref.abs().max().item()

        def product(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
            if glu:
                return self.gemv_silu_mul(x, w, cfg, scale=scale)
            return self.gemv(x, w, None, cfg, scale=scale)

        def run(cfg: GemvConfig) -> None:
            if time.monotonic() > deadline or any(t["config"] == asdict(cfg) for t in res.tried):
                return
            entry: dict[str, Any] = {"config": asdict(cfg)}
            res.tried.append(entry)
            try:
                y = product(x, ws[0], cfg)
                err = (y.float() - ref).abs().max().item() / ref_max
                if not err <= TOL:
                    raise ValueError(f"max error {err:.2e} of the largest output > {TOL:.1e}")
                launches = [partial(product, x, w, cfg) for w in ws]
                entry["us"] = graph_us(launches, LAUNCHES, REPLAYS)
            except Exception as exc:  # a bad config is reported and skipped, the sweep goes on
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                log(f"{shape.label} M={rows} {cfg}: skipped, {entry['error']}")

        # the peer first, so that it is there whatever the budget leaves; FP8 weights: cuBLAS on bf16 copies
        dense = [w if scale is None else w.to(torch.bfloat16) for w in ws]
        try:
            res.cublas_us = graph_us([partial(F.linear, x, w) for w in dense], LAUNCHES, REPLAYS)
        except Exception as exc:
            log(f"{shape.label} M={rows} cuBLAS: skipped, {type(exc).__name__}: {exc}")
        dense.clear()
        run(self.choose_config(self.dev, ws[0].dtype, shape.n, shape.k, rows))
        for cfg in configs:
            run(cfg)
        ranked = [GemvConfig(**t["config"]) for t in sorted(res.timed(), key=lambda t: t["us"])]
        for cfg in refinements([c for c in ranked if c.split_k == 1], rows):
            run(cfg)
        for extra in (partial(with_narrow, rows=rows, fp8=self.fp8), with_prefetch):
            for cfg in extra([GemvConfig(**t["config"]) for t in sorted(res.timed(), key=lambda t: t["us"])]):
                run(cfg)


def precompile(
    bench: Bench, grids: dict[int, list[GemvConfig]], deadline: float
) -> dict[int, list[GemvConfig]]:
    """Compiles each grid's configs, plain and with SiLU x up, on a small product with the big shapes'
    specialisations (N and K multiples of 16) until `deadline`; returns the grids without the configs that
    failed (those not reached compile in the sweep instead)."""
    out = {rows: list(grid) for rows, grid in grids.items()}
    weight = torch.float8_e4m3fn if bench.fp8 else torch.bfloat16
    w = torch.randn(256, 4096, device=bench.dev, generator=bench.gen).to(weight)
    scale = torch.ones(256, device=bench.dev) if bench.fp8 else None
    for rows, grid in grids.items():
        x = torch.randn(rows, 4096, device=bench.dev, generator=bench.gen).to(torch.bfloat16)
        for cfg in grid:
            if time.monotonic() > deadline:
                break
            try:
                bench.gemv(x, w, None, cfg, scale=scale)
                bench.gemv_silu_mul(x, w, cfg, scale=scale)  # gate+up's kernel (GLU) is another compile
            except Exception as exc:
                out[rows].remove(cfg)
                log(f"precompile M={rows} {cfg}: skipped, {type(exc).__name__}: {str(exc)[:160]}")
    torch.cuda.synchronize(bench.dev)
    return out


def gemv_bytes(shape: Shape, rows: int, fp8: bool) -> int:
    weight = shape.n * shape.k * (1 if fp8 else 2) + (4 * shape.n if fp8 else 0)
    return weight + 2 * rows * (shape.k + (shape.n // 2 if shape.name == "gate_up" else shape.n))


def table_updates(
    results: Iterable[Result], device: str, weight: str
) -> tuple[dict[TableKey, GemvConfig], set[TableKey]]:
    """(entries to write, entries to remove) for the config table: every measured bucket up to 16 rows; above
    16 the best tile where it beat cuBLAS, else the key, so that the model keeps cuBLAS there."""
    keep: dict[TableKey, GemvConfig] = {}
    drop: set[TableKey] = set()
    for res in results:
        best = res.best()
        if best is None:
            continue
        key = TableKey(device, weight, res.shape.n, res.shape.k, m_bucket(res.rows))
        if res.rows <= GEMV_ROWS or (res.cublas_us is not None and best["us"] < res.cublas_us):
            keep[key] = GemvConfig(**best["config"])
        else:
            drop.add(key)
    return keep, drop


def fmt_cfg(c: dict[str, Any]) -> str:
    flags = (" prefetch" if c.get("prefetch") else "") + (" narrow" if c.get("narrow_w") else "")
    return f"{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']} k{c['split_k']}{flags}"


def markdown(shape: Shape, results: list[Result], copy_bw: float, fp8: bool) -> str:
    lines = [f"### {shape.label}", "",
             "| M | best config (n x k, warps, stages, split, PDL, narrow) | µs | GiB/s | % of copy | "
             "current µs | cuBLAS µs | GEMV / cuBLAS | tried / failed |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        best, tried = r.best(), len(r.tried)
        failed = tried - len(r.timed())
        heur = r.tried[0].get("us") if r.tried else None
        cublas = f"{r.cublas_us:.1f}" if r.cublas_us is not None else "-"
        if best is None:
            lines.append(f"| {r.rows} | not measured | - | - | - | - | {cublas} | - | {tried} / {failed} |")
            continue
        bw = gemv_bytes(shape, r.rows, fp8) / (best["us"] / 1e6)
        ratio = f"{best['us'] / r.cublas_us:.2f}x" if r.cublas_us else "-"
        lines.append(f"| {r.rows} | {fmt_cfg(best['config'])} | {best['us']:.1f} | {bw / GIB:.0f} | "
                     f"{bw / copy_bw:.0%} | {'-' if heur is None else f'{heur:.1f}'} | {cublas} | {ratio} | "
                     f"{tried} / {failed} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tune the decode GEMV's tiles per shape on this GPU.")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="seconds to sweep for; what was measured by then is reported")  # fmt: skip
    parser.add_argument(
        "--rows", default="1,4,16", help=f"comma-separated M values (each at most {M_BUCKETS[-1]})"
    )
    parser.add_argument("--weight", default="bf16", choices=("bf16", "fp8"),
                        help="weight dtype (fp8: float8_e4m3fn, row scales, bf16 activations)")  # fmt: skip
    parser.add_argument("--out", default="gemv_sweep.json", help="every timing, as JSON")
    parser.add_argument("--table-out", default=None,
                        help="write the committed config table plus this device's best here")  # fmt: skip
    parser.add_argument("--models", default=",".join(f"{m}:{tp}" for m, tp in MODELS),
                        help="comma-separated model:tp pairs whose shapes are swept")  # fmt: skip
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args(argv)
    try:
        models = [(m, int(tp)) for m, _, tp in (pair.partition(":") for pair in args.models.split(","))]
    except ValueError:
        models = []
    if not models or not all(m in NAMED_SHAPES and tp >= 1 for m, tp in models):
        print(f"gemv_sweep: --models {args.models!r} must be comma-separated model:tp pairs of "
              f"{sorted(NAMED_SHAPES)}")  # fmt: skip
        return 2
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_list = []
    if not rows_list or not all(1 <= r <= M_BUCKETS[-1] for r in rows_list):
        print(f"gemv_sweep: --rows {args.rows!r} must be comma-separated integers from 1 to {M_BUCKETS[-1]}")
        return 2
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print(f"gemv_sweep: needs a CUDA device, got --device {args.device!r} "
              f"(CUDA available: {torch.cuda.is_available()})")  # fmt: skip
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    bench = Bench(dev, args.weight)
    device_name = torch.cuda.get_device_name(dev)
    log(f"{device_name}, torch {torch.__version__}, budget {args.budget_s:.0f} s: copy bandwidth")
    copy_bw = bench.copy_bandwidth()
    log(f"copy {copy_bw / GIB:.0f} GiB/s; compiling the grids")
    grids = precompile(bench, {r: base_grid(r, bench.fp8) for r in rows_list}, start + 0.5 * args.budget_s)
    log(f"{sum(map(len, grids.values()))} configs left after compiling, {time.monotonic() - start:.0f} s in")
    shapes = decode_shapes(models)
    # M = 1 first for every shape (the acceptance target), then the other row counts
    units = [(s, r) for r in rows_list for s in shapes]
    results: dict[tuple[Shape, int], Result] = {}
    for i, (shape, rows) in enumerate(units):
        left = deadline - time.monotonic()
        res = results[(shape, rows)] = Result(shape, rows)
        if left <= 0:
            continue
        share = time.monotonic() + left / (len(units) - i)
        try:
            bench.sweep_shape(shape, rows, grids[rows], share, res)
        except torch.cuda.OutOfMemoryError as exc:
            log(f"{shape.label} M={rows}: out of memory, skipped ({exc})")
        torch.cuda.empty_cache()
        best = res.best()
        best_us = "-" if best is None else f"{best['us']:.1f} us"
        log(f"{shape.label} M={rows}: {len(res.tried)} tried, best {best_us}")
    fp8 = args.weight == "fp8"
    for shape in shapes:
        print(markdown(shape, [results[(shape, r)] for r in rows_list], copy_bw, fp8), "\n", flush=True)
    weight_name = "float8_e4m3fn" if fp8 else "bfloat16"
    measured, cublas_wins = table_updates(results.values(), device_name, weight_name)
    doc: dict[str, Any] = {
        "device": device_name, "torch": torch.__version__, "weight": weight_name,
        "copy_bytes_per_s": copy_bw, "elapsed_s": time.monotonic() - start,
        "results": [{**asdict(s), "rows": r, "bytes": gemv_bytes(s, r, fp8), "cublas_us": res.cublas_us,
                     "tried": res.tried} for (s, r), res in results.items()],
        "table": table_document(measured),
    }  # fmt: skip
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    if args.table_out is not None:
        table = {**load_table(TABLE_PATH), **parse_table(doc["table"])}
        for key in cublas_wins:
            table.pop(key, None)
        with open(args.table_out, "w", encoding="utf-8") as f:
            json.dump(table_document(table), f, indent=1)
            f.write("\n")
    log(f"done in {time.monotonic() - start:.0f} s: {len(measured)} configs -> {args.out}"
        + (f", table -> {args.table_out}" if args.table_out else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
