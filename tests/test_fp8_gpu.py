"""The FP8 paths compiled for the GPU (sm_89+): attention over an FP8 cache and the RoPE + KV write into
one against the torch reference on the same bytes, and the FP8 weight products (Triton GEMV for decode,
torch._scaled_mm above 16 rows) against the product of the dequantized weights, at Llama-3.1-8B shapes.
Marked gpu, as tests/test_fused_gpu.py: they need CUDA and compiled Triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from pdserve.kernels.ops import AttentionMetadata, RopeTables
from pdserve.kernels.reference import ReferenceOps, write_kv
from pdserve.kernels.triton_attention import paged_decode_attention
from pdserve.kernels.triton_gemv import gemv
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.model.fp8 import quantize_rowwise, scaled_mm, unsupported_reason
from pdserve.shared.model.model import rope_inv_freq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.extras,  # needs triton, the [gpu] extra
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(bool(triton.knobs.runtime.interpret), reason="Triton is interpreting here"),
    pytest.mark.skipif(
        torch.cuda.is_available() and unsupported_reason(torch.device("cuda")) is not None,
        reason="needs compute capability 8.9 or newer",
    ),
]
FP8 = torch.float8_e4m3fn
REF, TRI = ReferenceOps(), TritonOps()
DEV = torch.device("cuda")


def _cache(
    lens: list[int], n_kv: int = 8, d: int = 128, block: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache [2, N, B, Hkv, D] holding random K/V for sequences of `lens` tokens, and their tables."""
    gen = torch.Generator(device=DEV).manual_seed(sum(lens))
    n_blocks = sum(-(-n // block) for n in lens)
    kv = torch.zeros(2, n_blocks + 1, block, n_kv, d, dtype=FP8, device=DEV)
    tables = torch.zeros(len(lens), max(-(-n // block) for n in lens), dtype=torch.int32, device=DEV)
    slots, first = [], 0
    for s, n in enumerate(lens):
        k = -(-n // block)
        tables[s, :k] = torch.arange(first, first + k, device=DEV)
        slots += [(first + i // block) * block + i % block for i in range(n)]
        first += k
    key, value = (torch.randn(len(slots), n_kv, d, device=DEV, generator=gen) for _ in range(2))
    write_kv(key, value, kv, torch.tensor(slots, device=DEV))
    return kv, tables


def _meta(lens: list[int], q_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        positions=torch.cat([torch.arange(n - q, n, device=DEV) for n, q in zip(lens, q_lens, strict=True)]),
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=DEV),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        rope=RopeTables.from_inv_freq(rope_inv_freq(128, 5e5, None), max(lens), DEV),
    )


@pytest.mark.parametrize("lens", [[1, 100, 4096], [37] * 8])
def test_decode_and_prefill_read_an_fp8_cache_as_the_reference(lens: list[int]) -> None:
    kv, tables = _cache(lens)
    q = torch.randn(len(lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    meta = _meta(lens, [1] * len(lens), tables)
    got, want = TRI.decode_attention(q, kv, meta, 0.088), REF.decode_attention(q, kv, meta, 0.088)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    q_lens = [min(n, 16) for n in lens]
    qp = torch.randn(sum(q_lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    meta = _meta(lens, q_lens, tables)
    got, want = TRI.prefill_attention(qp, kv, meta, 0.088), REF.prefill_attention(qp, kv, meta, 0.088)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_n", [None, 128])
def test_fp8_decode_is_closer_to_fp32_attention_than_bf16(block_n: int | None) -> None:
    # e4m3 widens to fp16 exactly and the kernel rounds q and P to fp16 (11 bits): against attention in
    # fp32 on the same FP8 values it must beat the reference, which computes in bf16 (8 bits). Long
    # contexts, so P's rounding counts; the default tile (32 keys: inside a 64-token page) and one that covers
    # pages.
    lens = [4096, 3000, 4000, 1000]
    kv, tables = _cache(lens, block=64)
    q = torch.randn(len(lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    meta = _meta(lens, [1] * len(lens), tables)
    exact = REF.decode_attention(q.float(), kv, meta, 0.088)  # widened to fp32, computed in fp32
    got = paged_decode_attention(q, kv, tables, meta.seq_lens, 0.088, 2, block_n=block_n).float()
    bf16 = REF.decode_attention(q, kv, meta, 0.088).float()
    err, ref_err = (got - exact).abs().mean().item(), (bf16 - exact).abs().mean().item()
    assert err < 0.8 * ref_err, (err, ref_err)
    assert (got - exact).abs().max().item() < 1e-3


def test_rope_write_into_an_fp8_cache_saturates_and_rounds_as_the_reference() -> None:
    qkv = torch.randn(8, 48 * 128, device=DEV, dtype=torch.bfloat16) * 60
    qkv[:, 40 * 128] = 1000.0  # the first V channel (V is not rotated) past +-448: it must saturate
    qkv[::2, 40 * 128] = -1000.0
    kv_tri = torch.zeros(2, 4, 16, 8, 128, dtype=FP8, device=DEV)
    kv_ref = kv_tri.clone()
    meta = _meta([8], [8], torch.zeros(1, 1, dtype=torch.int32, device=DEV))
    meta = dataclasses.replace(meta, slot_mapping=torch.arange(8, device=DEV) * 3)
    TRI.rope_write_kv(qkv.clone(), kv_tri, meta, 32)
    REF.rope_write_kv(qkv.clone(), kv_ref, meta, 32)
    got, want = kv_tri.float(), kv_ref.float()
    assert not got.isnan().any() and got.abs().max() == 448.0
    # RoPE may differ by a fused multiply-add (1 ulp in fp32), which can flip an FP8 rounding: one step
    assert ((got - want).abs() <= want.abs() * 2**-3 + 2**-9).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_products_equal_the_dequantized_weights_product(n: int, k: int) -> None:
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    q, scale = quantize_rowwise(w)
    dequantized = q.float() * scale[:, None]
    for rows in (1, 8):  # the Triton GEMV: exact weights, x in bf16, fp32 sums rounded once
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        want = x.float() @ dequantized.t()
        got = gemv(x, q, None, scale=scale).float()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    x = torch.randn(256, k, device=DEV, dtype=torch.bfloat16)  # _scaled_mm: x quantized per token as well
    want = x.float() @ dequantized.t()
    got = scaled_mm(x, q, scale, None).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2
