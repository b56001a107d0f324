"""The Triton GEMV (kernels/triton_gemv.py) against F.linear in fp32 arithmetic, under the interpreter on
the CPU and compiled where CUDA is: one row and several, with and without bias, ragged N and K, each dtype,
and through the model's GPU matmul backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pdserve.kernels.linear import GemvLinear
from pdserve.kernels.triton_gemv import MAX_ROWS, GemvConfig, default_config, gemv

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 3, 16])
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
    assert default_config(40, 300, 1).block_k == 512 and default_config(40, 300, 4).block_n == 32
    got = GemvLinear().linear(x, w, None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    row = gemv(x[:1].contiguous(), w, None)
    torch.testing.assert_close(row, F.linear(x[:1], w), rtol=1e-5, atol=1e-4)


def test_shapes_are_checked() -> None:
    w = torch.ones(8, 4)
    with pytest.raises(AssertionError, match=r"x \[M<=16, K\] and weight \[N, K\]"):
        gemv(torch.ones(MAX_ROWS + 1, 4), w, None)
    with pytest.raises(AssertionError, match="share a dtype"):
        gemv(torch.ones(1, 4, dtype=torch.bfloat16), w, None)
    with pytest.raises(AssertionError, match=r"bias must be \[8\]"):
        gemv(torch.ones(1, 4), w, torch.ones(3))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_with_row_scales(rows: int, dtype: torch.dtype) -> None:
    # W = q * scale[:, None]: the kernel widens q in registers and scales the fp32 sum (shared/model/fp8.py)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 100, generator=gen).to(DEV, dtype)
    q = (torch.randn(70, 100, generator=gen) * 100).to(torch.float8_e4m3fn).to(DEV)
    scale = (torch.rand(70, generator=gen) * 1e-3 + 1e-4).to(DEV)
    b = torch.randn(70, generator=gen).to(DEV, dtype)
    got = gemv(x, q, b, GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2), scale=scale)
    want = _want(x, q.float() * scale[:, None], b)
    assert got.dtype == dtype and got.shape == (rows, 70)
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * want.float().abs().max().item()
    with pytest.raises(AssertionError, match="an FP8 weight comes with its scale"):
        gemv(x, q, None)
