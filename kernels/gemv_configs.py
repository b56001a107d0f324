"""Which tiles the decode GEMV (kernels/triton_gemv.py) launches with: a table of configs measured per device,
weight dtype, shape and batch bucket (gemv_configs.json beside this file, written by
benchmarks/gemv_sweep.py), and a heuristic for the shapes the table does not hold.

Invariants: a config's tiles are powers of two and its split_k >= 1; a table key is (device name as CUDA
reports it, weight dtype name, N, K, M bucket), and `m_bucket` maps every row count a launch takes (1..64)
to the bucket it is tuned under; an entry of a bucket above GEMV_ROWS (17-64 rows) exists only where the
sweep measured the GEMV faster than cuBLAS for that device, weight dtype and shape, and its presence is what
sends those rows to the GEMV (kernels/triton_gemv.py's `runs_gemv`); the table is read once, at import, and
never changes afterwards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("gemv_configs.json")
M_BUCKETS = (1, 4, 16, 32, 64)  # a launch of M rows is tuned under the smallest bucket >= M
GEMV_ROWS = 16  # up to this many rows the GEMV always runs (tuned or heuristic); above, only where tuned
TABLE_VERSION = 2  # 2: `pdl` became `prefetch` once every decode kernel launched with PDL


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of one launch: each program owns block_n output columns and 1/split_k of K, read in block_k
    steps. split_k > 1 writes fp32 partial sums that a second kernel adds in split order (deterministic).
    prefetch: where the launch is programmatic (kernels/pdl.py: sm_90+), the program's first weight tile is
    asked of L2 before it waits for the kernel before it; ignored elsewhere. Per shape, as the sweep finds
    it: on every 8B shape at one row it cost a bf16 step 17 % (docs/benchmarks.md, PDL). narrow_w (one
    row): weight loads of 8 elements a thread, for FP8 the layout of bf16 x's loads, so x needs no relayout
    per K step (no-op for bf16). Tables written before these fields existed load with them off."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    prefetch: bool = False
    narrow_w: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, (
                f"GemvConfig.{name} must be a power of two, got {value}"
            )
        assert self.num_stages >= 1 and self.split_k >= 1, (
            f"GemvConfig needs num_stages >= 1 and split_k >= 1, got {self.num_stages} and {self.split_k}"
        )


@dataclass(frozen=True)
class TableKey:
    device: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    weight: str  # the weight's dtype without "torch.": "bfloat16", "float8_e4m3fn", ...
    n: int
    k: int
    m_bucket: int


def m_bucket(rows: int) -> int:
    for bucket in M_BUCKETS:
        if rows <= bucket:
            return bucket
    raise AssertionError(f"a GEMV takes at most {M_BUCKETS[-1]} rows, got {rows}")


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def default_config(n: int, k: int, rows: int, sm_count: int) -> GemvConfig:
    """The heuristic for shapes the table lacks. One row: two output columns per program over up to 4096 of
    K at a time, the most programs and the longest loads in flight. Up to 16 rows: 32 x 256 tiles for tl.dot;
    more: 64 x 128 (x's tile grows with the rows, so shorter K steps keep the stages in shared memory).
    Where that leaves fewer programs than SMs (few output columns), K is split so that every SM gets about
    two programs, each split at least two block_k steps long."""
    if rows == 1:
        cfg = GemvConfig(block_n=2, block_k=min(4096, _pow2_at_least(k)), num_warps=8, num_stages=2)
    else:
        block_n, block_k = (32, 256) if rows <= GEMV_ROWS else (64, 128)
        cfg = GemvConfig(block_n, min(block_k, max(16, _pow2_at_least(k))), num_warps=4, num_stages=3)
    programs = -(-n // cfg.block_n)
    if programs >= sm_count:
        return cfg
    split = min(-(-2 * sm_count // programs), max(1, k // (2 * cfg.block_k)))
    return replace(cfg, split_k=split)


def parse_table(doc: dict[str, Any]) -> dict[TableKey, GemvConfig]:
    """gemv_configs.json's document -> its configs. Raises AssertionError naming a bad entry."""
    assert doc.get("version") == TABLE_VERSION, (
        f"gemv config table version {doc.get('version')!r}, this code reads {TABLE_VERSION}: rerun "
        "benchmarks/gemv_sweep.py"
    )
    table: dict[TableKey, GemvConfig] = {}
    for entry in doc["configs"]:
        key = TableKey(entry["device"], entry["weight"], entry["n"], entry["k"], entry["m_bucket"])
        assert key.m_bucket in M_BUCKETS, f"m_bucket must be one of {M_BUCKETS}, got {entry}"
        table[key] = GemvConfig(**entry["config"])
    return table


def table_document(table: dict[TableKey, GemvConfig]) -> dict[str, Any]:
    """The inverse of `parse_table`, entries sorted so that a rewritten file diffs cleanly."""
    entries = [{**asdict(key), "config": asdict(cfg)} for key, cfg in table.items()]
    entries.sort(key=lambda e: (e["device"], e["weight"], e["n"], e["k"], e["m_bucket"]))
    return {"version": TABLE_VERSION, "configs": entries}


def load_table(path: Path = TABLE_PATH) -> dict[TableKey, GemvConfig]:
    with open(path, encoding="utf-8") as f:
        return parse_table(json.load(f))


TUNED = load_table()
