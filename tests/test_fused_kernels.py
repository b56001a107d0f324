"""Fused Triton kernels (add + RMSNorm, Qwen3's q/k norm, RoPE + KV write, SiLU x up) against their torch
reference twins, on CPU tensors under the Triton interpreter, and a whole decoder (Llama and Qwen3) through
them against the reference ops.

tests/harness/triton_interpreter.py switches the interpreter on; tests/conftest.py installs the
numpy >= 2.4 interpreter fix. Unwritten cache slots hold a large value, so a write to the wrong slot shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pdserve.kernels.linear import GemvLinear
from pdserve.kernels.ops import AttentionMetadata, AttentionOps, QKNorm, RopeTables
from pdserve.kernels.reference import ReferenceOps
from pdserve.kernels.triton_fused import _rms_norm_kernel
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.model import LlamaModel, rope_inv_freq
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.tests.harness import triton_interpreter  # noqa: F401  (the interpreter, or a skip on CUDA)
from triton.runtime.interpreter import InterpretedFunction

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`


REF = ReferenceOps()
TRI = TritonOps()
POISON = 50.0
DTYPES = [torch.float32, torch.bfloat16]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal up to summation order. bf16: the interpreter narrows fp32 to bf16 by truncation where
    torch rounds to nearest, 1 ulp (up to 2^-7 relative) per rounding, and a norm rounds twice."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    tol = 1e-6 if want.dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kernels_run_under_the_interpreter() -> None:
    assert isinstance(_rms_norm_kernel, InterpretedFunction), "triton was imported before this module"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # a power of two, and one the kernel pads
def test_rms_norm_and_add_rms_norm_match_reference(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    _assert_close(TRI.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5))

    res_tri, res_ref = residual.clone(), residual.clone()
    normed_tri, out_tri = TRI.add_rms_norm(x, res_tri, weight, 1e-5)
    normed_ref, out_ref = REF.add_rms_norm(x, res_ref, weight, 1e-5)
    assert out_tri is res_tri and out_ref is res_ref  # the stream is updated in place
    _assert_close(res_tri, residual + x)
    _assert_close(res_ref, residual + x)
    _assert_close(normed_tri, normed_ref)


def test_rms_norm_strided_rows() -> None:
    # rows of a wider buffer: the kernel follows the row stride
    base = torch.randn(4, 80)
    x, weight = base[:, :64], torch.rand(64) + 0.5
    _assert_close(TRI.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))


def _rope_case(
    dtype: torch.dtype, n_q: int, n_kv: int, head_dim: int, kv_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """qkv [6, (Hq + 2 Hkv) * D], a poisoned cache [2, 3, 16, Hkv, D] (in `kv_dtype`, default qkv's) and
    the metadata of six one-token sequences at scattered positions (what RoPE + KV write read: positions,
    slots and the tables)."""
    gen = torch.Generator().manual_seed(head_dim + n_q)
    max_pos = 300
    qkv = torch.randn(6, (n_q + 2 * n_kv) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 17, 299, 5, 128], dtype=torch.int64)
    meta = AttentionMetadata(
        positions=positions,
        # slot -1: a padding row, whose q is still rotated but whose K/V go nowhere
        slot_mapping=torch.tensor([3, 0, 31, -1, 16, 8], dtype=torch.int64),
        query_start_loc=torch.arange(7, dtype=torch.int32),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=torch.zeros(6, -(-max_pos // 16), dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max_pos,
        rope=RopeTables.from_inv_freq(rope_inv_freq(head_dim, 10000.0, None), max_pos, torch.device("cpu")),
    )
    kv = torch.full((2, 3, 16, n_kv, head_dim), POISON, dtype=kv_dtype or dtype)
    return qkv, kv, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(4, 2, 16), (6, 3, 12), (8, 8, 64)])
def test_rope_write_kv_matches_reference(dtype: torch.dtype, n_q: int, n_kv: int, head_dim: int) -> None:
    qkv, kv, meta = _rope_case(dtype, n_q, n_kv, head_dim)
    slots = meta.slot_mapping
    qkv_tri, qkv_ref, kv_tri, kv_ref = qkv.clone(), qkv.clone(), kv.clone(), kv.clone()
    q_tri = TRI.rope_write_kv(qkv_tri, kv_tri, meta, n_q)
    q_ref = REF.rope_write_kv(qkv_ref, kv_ref, meta, n_q)
    assert q_tri.shape == (6, n_q, head_dim) and q_tri.data_ptr() == qkv_tri.data_ptr()  # a view of qkv
    _assert_close(q_tri, q_ref)
    _assert_close(kv_tri, kv_ref)
    q_cols = n_q * head_dim
    assert torch.equal(qkv_tri[:, q_cols:], qkv[:, q_cols:])  # k and v columns are left as they were
    assert torch.equal(qkv_ref[:, q_cols:], qkv[:, q_cols:])
    flat = kv_tri.view(2, -1, n_kv, head_dim)
    assert (flat[:, [s for s in range(48) if s not in slots.tolist()]] == POISON).all()
    # V is copied unrotated; position 0 leaves K unrotated too
    v = qkv[:, q_cols + n_kv * head_dim :].view(6, n_kv, head_dim)
    assert torch.equal(flat[1, slots[slots >= 0]], v[slots >= 0])
    assert torch.equal(flat[0, 3], qkv[0, q_cols : q_cols + n_kv * head_dim].view(n_kv, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_quantizes_into_an_fp8_cache_as_the_reference_does(dtype: torch.dtype) -> None:
    fp8 = torch.float8_e4m3fn
    qkv, kv, meta = _rope_case(dtype, 4, 2, 64, kv_dtype=fp8)
    qkv[1, 4 * 64 :] = 1000.0  # token 1's K and V: past e4m3's 448, saturated (a bare cast may give NaN)
    qkv_tri, qkv_ref, kv_tri, kv_ref = qkv.clone(), qkv.clone(), kv.clone(), kv.clone()
    _assert_close(TRI.rope_write_kv(qkv_tri, kv_tri, meta, 4), REF.rope_write_kv(qkv_ref, kv_ref, meta, 4))
    # The interpreter's conversion to e4m3 (numpy; a GPU converts in hardware) is not torch's: it flushes
    # subnormals (|x| < 2^-6), may round the other way (1 step of e4m3's 3 mantissa bits), and does not
    # carry a rounding into the exponent (1.97 becomes 1.0 where torch and the GPU give 2.0).
    got, want = kv_tri.float(), kv_ref.float()
    normal = want.abs() >= 2**-6
    same_or_next = (got - want).abs() <= want.abs() * 2**-3
    carry_lost = got * 2 == want
    assert (same_or_next | carry_lost)[normal].all()
    assert (got == want)[normal].float().mean() > 0.9
    torch.testing.assert_close(got[~normal], want[~normal], rtol=0.0, atol=2**-6)
    flat = kv_tri.view(2, -1, 2, 64).float()
    assert (flat[1, 0] == 448.0).all() and not flat.isnan().any()  # token 1's V went to slot 0, saturated


def test_rope_is_the_rotate_half_of_hugging_face_in_fp32() -> None:
    qkv, kv, meta = _rope_case(torch.float32, 4, 2, 16)
    q = qkv[:, : 4 * 16].view(6, 4, 16)
    c, s = meta.rope.cos[meta.positions][:, None], meta.rope.sin[meta.positions][:, None]
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    want = q * torch.cat((c, c), -1) + rotate_half * torch.cat((s, s), -1)
    got = TRI.rope_write_kv(qkv.clone(), kv, meta, 4)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2 * 1500, generator=gen) * 4).to(dtype)  # 1500 spans two column blocks
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # exp overflow on either side
    _assert_close(TRI.silu_mul(gate_up), REF.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(4, 2, 16), (5, 1, 24)])  # 24: a padded half
def test_rope_write_kv_with_qk_norm_normalises_q_and_k_heads_first(
    dtype: torch.dtype, n_q: int, n_kv: int, head_dim: int
) -> None:
    """Qwen3's per-head q/k RMSNorm in RoPE's pass: the fused kernel gives the reference's q and cache,
    leaves qkv's k and v columns as they were, and each head is its own RMSNorm times its weight (q heads
    q_w, k heads k_w; seen unrotated at position 0), then rotated as without the norm."""
    qkv, kv, meta = _rope_case(dtype, n_q, n_kv, head_dim)
    qkv.mul_(4)
    gen = torch.Generator().manual_seed(n_q * head_dim)
    q_w = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_w = (1 - 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    norm = QKNorm(q_w, k_w, 1e-6)
    qkv_tri, qkv_ref, kv_tri, kv_ref = qkv.clone(), qkv.clone(), kv.clone(), kv.clone()
    q_tri = TRI.rope_write_kv(qkv_tri, kv_tri, meta, n_q, norm)
    q_ref = REF.rope_write_kv(qkv_ref, kv_ref, meta, n_q, norm)
    _assert_close(q_tri, q_ref)
    _assert_close(kv_tri, kv_ref)
    q_cols = n_q * head_dim
    assert torch.equal(qkv_tri[:, q_cols:], qkv[:, q_cols:]) and torch.equal(qkv_ref, qkv)
    heads = qkv[0].view(-1, head_dim).float()  # token 0, at position 0: cos 1, sin 0
    rms = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    _assert_close(q_ref[0], (rms[:n_q] * q_w.float()).to(dtype))
    _assert_close(kv_ref[0].view(-1, n_kv, head_dim)[3], (rms[n_q : n_q + n_kv] * k_w.float()).to(dtype))


def test_boundary_checks_name_the_bad_value() -> None:
    qkv, kv, meta = _rope_case(torch.float32, 4, 2, 16)
    with pytest.raises(AssertionError, match=r"qkv must be \[T, 144\] for 5 q heads"):
        TRI.rope_write_kv(qkv, kv, meta, 5)
    with pytest.raises(AssertionError, match=r"positions must be torch.int64"):
        TRI.rope_write_kv(qkv, kv, dataclasses.replace(meta, positions=meta.positions.int()), 4)
    with pytest.raises(AssertionError, match=r"slot_mapping must be torch.int64"):
        TRI.rope_write_kv(qkv, kv, dataclasses.replace(meta, slot_mapping=meta.slot_mapping.int()), 4)
    with pytest.raises(AssertionError, match=r"RoPE cos must be fp32 \[P, D/2\]"):
        RopeTables(meta.rope.cos.bfloat16(), meta.rope.sin)
    narrow = RopeTables(meta.rope.cos[:, :4].contiguous(), meta.rope.sin[:, :4].contiguous())
    with pytest.raises(AssertionError, match=r"RoPE tables must be \[P, 8\]"):
        TRI.rope_write_kv(qkv, kv, dataclasses.replace(meta, rope=narrow), 4)
    with pytest.raises(AssertionError, match=r"x dtype torch.bfloat16 must equal the weight's torch.float32"):
        TRI.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(AssertionError, match=r"residual must be \[T, E\] with weight \[E\]"):
        TRI.add_rms_norm(torch.ones(2, 8), torch.ones(2, 9), torch.ones(8), 1e-5)
    with pytest.raises(AssertionError, match=r"gate_up must be \[T, 2F\]"):
        TRI.silu_mul(torch.ones(2, 7))


def _tiny_model(dtype: torch.dtype, shape: str = "smollm2-135m") -> LlamaModel:
    """Two small layers of `shape`'s architecture (qwen3-8b: q/k norms, head_dim apart from hidden/heads)."""
    cfg = NAMED_SHAPES[shape]
    if shape.startswith("qwen3"):
        cfg = dataclasses.replace(cfg, num_heads=4, num_kv_heads=2, head_dim=32, bos_token_id=None,
                                  eos_token_ids=(1,))  # fmt: skip
    cfg = dataclasses.replace(cfg, num_layers=2, vocab_size=256, hidden_size=96, intermediate_size=160)
    model = LlamaModel(cfg, torch.device("cpu"), dtype)
    fill_dummy_weights(model, seed=4)
    with torch.no_grad():  # norms of 1 would hide a wrong weight multiply
        for layer in model.decoder_layers:
            for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return model


def _prefill_then_decode(model: LlamaModel, ops: AttentionOps, tokens: list[int]) -> torch.Tensor:
    """Prefill all but the last token, then decode it; logits [2, V] of both steps' last rows."""
    c, block = model.config, 16
    kv = torch.zeros(c.num_layers, 2, 4, block, c.num_kv_heads, c.head_dim, dtype=model.dtype)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    n = len(tokens)
    rows = []
    for start, end in ((0, n - 1), (n - 1, n)):
        pos = torch.arange(start, end)
        meta = AttentionMetadata(
            positions=pos,
            slot_mapping=table[0, pos // block].long() * block + pos % block,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table,
            max_query_len=end - start,
            max_seq_len=end,
            rope=model.rope,
        )
        hidden = model.forward(torch.tensor(tokens[start:end]), kv, meta, ops)
        rows.append(model.compute_logits(hidden[-1:]))
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-8b"])
@pytest.mark.parametrize("gemv", [False, True])
def test_decoder_through_fused_kernels_matches_reference(dtype: torch.dtype, shape: str, gemv: bool) -> None:
    # gemv: the GPU's products (kernels/linear.py's GemvLinear): the decode step's through the Triton GEMV,
    # its MLP's gate+up with SiLU x up fused into the GEMV; the 20-token prefill's through F.linear
    torch.set_num_threads(1)
    model = _tiny_model(dtype, shape)
    tokens = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        want = _prefill_then_decode(model, REF, tokens)
        if gemv:
            model.prepare_weights(GemvLinear())
        got = _prefill_then_decode(model, TRI, tokens)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
