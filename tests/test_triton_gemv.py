"""The Triton GEMV (kernels/triton_gemv.py) against F.linear in fp32 arithmetic, under the interpreter on
the CPU and compiled where CUDA is: one row and several, with and without bias, ragged N and K, each dtype,
split-K (FP8 weights too), the tuned-config table (kernels/gemv_configs.py), and through the model's GPU
matmul backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pdserve.kernels import gemv_configs, triton_gemv
from pdserve.kernels.gemv_configs import (
    TableKey,
    default_config,
    load_table,
    m_bucket,
    parse_table,
    table_document,
)
from pdserve.kernels.linear import GemvLinear
from pdserve.kernels.triton_gemv import MAX_ROWS, GemvConfig, choose_config, gemv, gemv_silu_mul, runs_gemv

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(DEV, dtype)
    w = torch.randn(70, 100, generator=gen).to(DEV, dtype)  # N and K not multiples of the tiles
    b = torch.randn(70, generator=gen).to(DEV, dtype) if with_bias else None
    got = gemv(x, w, b, GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2))
    want = _want(x, w, b)
    scale = want.float().abs().max().item()
    assert got.dtype == dtype and got.shape == (rows, 70)
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale


def test_default_tiles_and_strided_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40, 300, generator=gen).to(DEV)
    x = torch.randn(6, 600, generator=gen).to(DEV)[:, ::2]  # strided rows: the backend makes them contiguous
    assert default_config(40, 300, 1, 132).block_k == 512 and default_config(40, 300, 4, 132).block_n == 32
    got = GemvLinear().linear(x, w, None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    row = gemv(x[:1].contiguous(), w, None)
    torch.testing.assert_close(row, F.linear(x[:1], w), rtol=1e-5, atol=1e-4)


def test_shapes_are_checked() -> None:
    w = torch.ones(8, 4)
    with pytest.raises(AssertionError, match=r"x \[M<=64, K\] and weight \[N, K\]"):
        gemv(torch.ones(MAX_ROWS + 1, 4), w, None)
    with pytest.raises(AssertionError, match="share a dtype"):
        gemv(torch.ones(1, 4, dtype=torch.bfloat16), w, None)
    with pytest.raises(AssertionError, match=r"bias must be \[8\]"):
        gemv(torch.ones(1, 4), w, torch.ones(3))


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("narrow", [False, True])
def test_fp8_weights_with_row_scales(rows: int, dtype: torch.dtype, narrow: bool) -> None:
    # W = q * scale[:, None]: the kernel widens q in registers and scales the fp32 sum (shared/model/fp8.py);
    # narrow_w (8-element weight loads, one row only) changes the loads' layout, not the result
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 100, generator=gen).to(DEV, dtype)
    q = (torch.randn(70, 100, generator=gen) * 100).to(torch.float8_e4m3fn).to(DEV)
    scale = (torch.rand(70, generator=gen) * 1e-3 + 1e-4).to(DEV)
    b = torch.randn(70, generator=gen).to(DEV, dtype)
    got = gemv(
        x, q, b, GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, narrow_w=narrow), scale=scale
    )
    want = _want(x, q.float() * scale[:, None], b)
    assert got.dtype == dtype and got.shape == (rows, 70)
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * want.float().abs().max().item()
    with pytest.raises(AssertionError, match="an FP8 weight comes with its scale"):
        gemv(x, q, None)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_split_k_matches_linear(rows: int, split_k: int) -> None:
    # K = 1000 in 32-wide steps: 7 splits of 5 steps leave the last one short and drop none; N = 70 ragged
    gen = torch.Generator().manual_seed(split_k)
    x = torch.randn(rows, 1000, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(70, 1000, generator=gen).to(DEV, torch.bfloat16)
    b = torch.randn(70, generator=gen).to(DEV, torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=split_k)
    got = gemv(x, w, b, cfg)
    want = _want(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
    assert _rel_err(got, want) <= TOL[torch.bfloat16]
    assert torch.equal(gemv(x, w, b, cfg), got)  # partials added in split order: the same bits every run


def test_prefetch_is_a_config_field_that_old_tables_lack() -> None:
    # tables written before `prefetch` existed load with it off; on the CPU (no programmatic launch) a
    # prefetch config runs as a plain launch
    old = {"version": 2, "configs": [{"device": "cpu", "weight": "float32", "n": 8, "k": 64, "m_bucket": 1,
                                      "config": {"block_n": 2, "block_k": 32, "num_warps": 4, "num_stages": 2,
                                                 "split_k": 2}}]}  # fmt: skip
    (cfg,) = parse_table(old).values()
    assert not cfg.prefetch and parse_table(table_document(parse_table(old))) == parse_table(old)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 64, generator=gen).to(DEV), torch.randn(8, 64, generator=gen).to(DEV)
    got = gemv(x, w, None, GemvConfig(2, 32, 4, 2, split_k=2, prefetch=True))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5])
def test_split_k_fp32_and_more_splits_than_steps(rows: int) -> None:
    # 40 splits asked over K = 100 in 32-wide steps: 4 steps, so 4 splits; fp32 keeps the tolerance tight
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 100, generator=gen).to(DEV)
    w = torch.randn(33, 100, generator=gen).to(DEV)
    got = gemv(x, w, None, GemvConfig(block_n=8, block_k=32, num_warps=4, num_stages=2, split_k=40))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_split_k_fp8_weights(rows: int) -> None:
    # the row scale and the bias are applied once, by the reduction, to the sum of the partials
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rows, 300, generator=gen).to(DEV, torch.bfloat16)
    q = (torch.randn(70, 300, generator=gen) * 100).to(torch.float8_e4m3fn).to(DEV)
    scale = (torch.rand(70, generator=gen) * 1e-3 + 1e-4).to(DEV)
    b = torch.randn(70, generator=gen).to(DEV, torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, split_k=3)
    got = gemv(x, q, b, cfg, scale=scale)
    want = _want(x, q.float() * scale[:, None], b)
    assert _rel_err(got, want) <= TOL[torch.bfloat16]


def test_heuristic_splits_k_when_columns_are_few() -> None:
    # 132 SMs: one row over N = 4096 gives 2048 programs, no split; 16 rows over N = 1024 give 32 programs
    assert default_config(4096, 4096, 1, 132).split_k == 1
    assert default_config(1024, 4096, 16, 132) == GemvConfig(32, 256, 4, 3, split_k=8)
    assert default_config(1024, 256, 16, 132).split_k == 1  # K of one step: nothing to split
    # on the CPU (4 "SMs" under the interpreter) 4 rows over N = 40 split K = 2048 four ways, unasked
    cfg = choose_config(torch.device("cpu"), torch.float32, 40, 2048, 4)
    assert cfg.split_k == 4
    if DEV.type == "cpu":
        gen = torch.Generator().manual_seed(5)
        x, w = torch.randn(4, 2048, generator=gen), torch.randn(40, 2048, generator=gen)
        torch.testing.assert_close(gemv(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-3)


def test_tuned_table_is_used_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = GemvConfig(block_n=4, block_k=64, num_warps=2, num_stages=1, split_k=2)
    key = TableKey("cpu", "float32", 24, 200, 4)  # rows 2..4 share the bucket of 4
    monkeypatch.setitem(gemv_configs.TUNED, key, tuned)
    cpu = torch.device("cpu")
    assert choose_config(cpu, torch.float32, 24, 200, 3) == tuned
    assert choose_config(cpu, torch.float32, 24, 200, 5) != tuned  # the bucket of 16: the heuristic
    assert choose_config(cpu, torch.bfloat16, 24, 200, 3) != tuned  # another weight dtype
    assert parse_table(table_document({key: tuned})) == {key: tuned}
    load_table()  # the committed table parses
    with pytest.raises(AssertionError, match="power of two"):
        GemvConfig(block_n=3, block_k=64, num_warps=4, num_stages=2)
    with pytest.raises(AssertionError, match=r"rerun benchmarks/gemv_sweep\.py"):
        parse_table({"version": 0, "configs": []})


@pytest.mark.parametrize("rows", [1, 3, 16, 24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_silu_mul_matches_unfused(rows: int, dtype: torch.dtype, split_k: int, fp8: bool) -> None:
    # gate+up GEMV with SiLU x up in its epilogue: the same bits as the GEMV then the SiLU x up kernel at the
    # same tiles; F = 35 and K = 300 ragged against the tiles, several K steps a program (or split)
    from pdserve.kernels.triton_fused import silu_mul

    gen = torch.Generator().manual_seed(rows * 10 + split_k)
    x = torch.randn(rows, 300, generator=gen).to(DEV, dtype)
    w = torch.randn(70, 300, generator=gen) * 0.2
    scale = None
    if fp8:
        scale = (torch.rand(70, generator=gen) * 1e-2 + 1e-3).to(DEV)
        w = (w * 50).to(torch.float8_e4m3fn).to(DEV)
    else:
        w = w.to(DEV, dtype)
    cfg = GemvConfig(
        block_n=32 if rows > 1 else 4, block_k=64, num_warps=4, num_stages=2, split_k=split_k, narrow_w=fp8
    )
    got = gemv_silu_mul(x, w, cfg, scale=scale)
    assert got.dtype == dtype and got.shape == (rows, 35)
    unfused = silu_mul(gemv(x, w, None, cfg, scale=scale))
    if DEV.type == "cuda":
        assert torch.equal(got, unfused)
    else:  # the interpreter's dot is numpy's matmul, whose BLAS (its version, its kernels by shape) may sum
        assert _rel_err(got, unfused) <= TOL[dtype]  # the fused and plain tiles in different orders
    wf = w.float() * (scale[:, None] if scale is not None else 1.0)
    gate_up = F.linear(x.float(), wf)
    want = F.silu(gate_up[:, :35]) * gate_up[:, 35:]
    assert _rel_err(got, want) <= 4 * TOL[dtype]


def test_gemv_silu_mul_checks_its_weight() -> None:
    with pytest.raises(AssertionError, match="even row count"):
        gemv_silu_mul(torch.ones(1, 4), torch.ones(7, 4))


@pytest.mark.parametrize("rows", [1, MAX_ROWS + 1])
def test_backend_gate_up_with_silu_mul(rows: int) -> None:
    # decode-sized products take the fused GEMV, larger ones F.linear and the caller's SiLU x up
    from pdserve.kernels.reference import ReferenceOps

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEV)
    w = torch.randn(2 * 40, 96, generator=gen).to(DEV)
    got = GemvLinear().linear_silu_mul(x, w, ReferenceOps().silu_mul)
    gate_up = F.linear(x, w)
    torch.testing.assert_close(got, F.silu(gate_up[:, :40]) * gate_up[:, 40:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [17, 64])
def test_rows_over_16_take_the_gemv_only_where_the_table_says(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 17-64 rows run the GEMV only where the table holds an entry for (device, weight dtype, shape, row
    # bucket): the sweep writes one only where the GEMV beat cuBLAS. Elsewhere F.linear (and the caller's
    # SiLU x up); the results agree either way
    from pdserve.kernels.reference import ReferenceOps

    calls: list[str] = []

    def spy(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(triton_gemv, "gemv", spy(triton_gemv.gemv))
    monkeypatch.setattr(triton_gemv, "gemv_silu_mul", spy(triton_gemv.gemv_silu_mul))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEV)
    w = torch.randn(80, 96, generator=gen).to(DEV)
    backend, silu_mul = GemvLinear(), ReferenceOps().silu_mul
    assert not runs_gemv(DEV, torch.float32, 80, 96, rows)
    dense = (backend.linear(x, w, None), backend.linear_silu_mul(x, w, silu_mul))
    assert calls == []
    device = "cpu" if DEV.type == "cpu" else torch.cuda.get_device_name(DEV)
    other = 64 if m_bucket(rows) == 32 else 32
    untuned = GemvConfig(32, 32, 4, 2)
    monkeypatch.setitem(gemv_configs.TUNED, TableKey(device, "float32", 80, 96, other), untuned)
    monkeypatch.setitem(gemv_configs.TUNED, TableKey(device, "bfloat16", 80, 96, m_bucket(rows)), untuned)
    assert not runs_gemv(DEV, torch.float32, 80, 96, rows)  # another bucket's or dtype's entry: cuBLAS
    assert runs_gemv(DEV, torch.float32, 80, 96, 16)  # up to 16 rows: always the GEMV
    assert not runs_gemv(DEV, torch.float32, 80, 96, MAX_ROWS + 1)
    tuned = GemvConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=2)
    monkeypatch.setitem(gemv_configs.TUNED, TableKey(device, "float32", 80, 96, m_bucket(rows)), tuned)
    assert runs_gemv(DEV, torch.float32, 80, 96, rows)
    triton_path = (backend.linear(x, w, None), backend.linear_silu_mul(x, w, silu_mul))
    assert calls == ["gemv", "gemv_silu_mul"]
    for got, want in zip(triton_path, dense, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_sweep_keeps_a_bucket_over_16_only_where_the_gemv_beat_cublas() -> None:
    # up to 16 rows the GEMV always runs, so its best tile is written whatever cuBLAS measured; above 16
    # the entry is written only where the GEMV was faster; a stale entry of a bucket cuBLAS wins is dropped
    from pdserve.benchmarks import gemv_sweep

    shape = gemv_sweep.Shape("llama-3.1-8b", 1, "o", 4096, 4096)
    cfg = GemvConfig(64, 128, 4, 3, split_k=4)

    def result(rows: int, us: float, cublas_us: float) -> gemv_sweep.Result:
        return gemv_sweep.Result(shape, rows, [{"config": asdict(cfg), "us": us}], cublas_us)

    results = [result(1, 12.0, 11.0), result(32, 10.0, 11.0), result(64, 12.5, 12.0)]
    keep, drop = gemv_sweep.table_updates(results, "NVIDIA H200", "bfloat16")
    key = TableKey("NVIDIA H200", "bfloat16", 4096, 4096, 1)
    assert keep == {key: cfg, replace(key, m_bucket=32): cfg}
    assert drop == {replace(key, m_bucket=64)}
    assert max(c.block_n for c in gemv_sweep.base_grid(64)) >= 64  # wider tiles where rows are many


def test_sweep_grid_shapes_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    # benchmarks/gemv_sweep.py's pure parts: FP8 one-row tiles reach twice bf16's elements (the same bytes),
    # --models narrows the shapes, gate+up's output is F wide (SiLU x up fused), a bad pair is one line
    from pdserve.benchmarks import gemv_sweep

    bf16, fp8 = gemv_sweep.base_grid(1), gemv_sweep.base_grid(1, fp8=True)
    assert max(c.block_n * c.block_k for c in bf16) == 16384 and max(c.block_k for c in bf16) == 4096
    assert max(c.block_n * c.block_k for c in fp8) == 32768 and set(bf16) < set(fp8)
    ranked = [GemvConfig(2, 4096, 4, 2, split_k=s) for s in (4, 1, 2, 8)]
    assert gemv_sweep.with_prefetch(ranked) == [replace(c, prefetch=True) for c in ranked[:3]]
    assert gemv_sweep.with_narrow(ranked, 1, fp8=True) == [replace(c, narrow_w=True) for c in ranked]
    assert gemv_sweep.with_narrow(ranked, 4, fp8=True) == gemv_sweep.with_narrow(ranked, 1, fp8=False) == []
    shapes = gemv_sweep.decode_shapes([("llama-3.1-8b", 1)])
    assert [s.name for s in shapes] == ["qkv", "o", "gate_up", "down", "lm_head"]
    # a mixture of experts: attention, the router and the LM head (its experts are the MoE kernels')
    moe = gemv_sweep.decode_shapes([("qwen3-30b-a3b", 1)])
    assert [(s.name, s.n, s.k) for s in moe] == [
        ("qkv", 5120, 2048),
        ("o", 2048, 4096),
        ("router", 128, 2048),
        ("lm_head", 151936, 2048),
    ]
    gate_up = shapes[2]
    assert gemv_sweep.gemv_bytes(gate_up, 1, False) == gate_up.n * gate_up.k * 2 + 2 * (
        gate_up.k + gate_up.n // 2
    )
    assert gemv_sweep.main(["--models", "llama-3.1-8b:x"]) == 2
    assert "--models 'llama-3.1-8b:x' must be comma-separated model:tp pairs" in capsys.readouterr().out
    assert gemv_sweep.main(["--rows", "64,65"]) == 2
    assert "--rows '64,65' must be comma-separated integers from 1 to 64" in capsys.readouterr().out
