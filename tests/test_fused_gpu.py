"""Fused Triton kernels compiled for the GPU against their torch reference twins at Llama-3.1-8B shapes,
and the kernels one captured batch-1 decode step launches. Marked gpu: they need CUDA and compiled (not
interpreted) Triton, so they skip under TRITON_INTERPRET=1 (the interpreter-only modules skip themselves
where CUDA is, so that they never switch a GPU test process to the interpreter). On the GPU the kernels
round to nearest as torch does, so most results are bit-equal; RoPE may differ by a fused multiply-add, 1 ulp.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import triton
from pdserve.kernels.ops import AttentionMetadata, QKNorm
from pdserve.kernels.reference import ReferenceOps
from pdserve.kernels.triton_attention import choose_prefill_splits
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.model.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.extras,  # needs triton, the [gpu] extra
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(bool(triton.knobs.runtime.interpret), reason="Triton is interpreting here"),
]
REF = ReferenceOps()
TRI = TritonOps()
C = NAMED_SHAPES["llama-3.1-8b"]
DTYPES = [torch.float32, torch.bfloat16]


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-6 if want.dtype == torch.float32 else 2**-7
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 7, 300])
def test_add_rms_norm_on_gpu(dtype: torch.dtype, n_tokens: int) -> None:
    dev = torch.device("cuda")
    x = torch.randn(n_tokens, C.hidden_size, device=dev).to(dtype)
    residual = torch.randn(n_tokens, C.hidden_size, device=dev).to(dtype)
    weight = torch.rand(C.hidden_size, device=dev).to(dtype) + 0.5
    res_tri, res_ref = residual.clone(), residual.clone()
    normed_tri, _ = TRI.add_rms_norm(x, res_tri, weight, C.rms_norm_eps)
    normed_ref, _ = REF.add_rms_norm(x, res_ref, weight, C.rms_norm_eps)
    assert torch.equal(res_tri, res_ref)  # the residual sum is rounded exactly as torch rounds it
    _ulp_close(normed_tri, normed_ref)
    _ulp_close(TRI.rms_norm(x, weight, C.rms_norm_eps), REF.rms_norm(x, weight, C.rms_norm_eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 300])
@pytest.mark.parametrize("with_qk_norm", [False, True])  # Qwen3's per-head q/k norm in RoPE's pass
def test_rope_write_kv_and_silu_mul_on_gpu(dtype: torch.dtype, n_tokens: int, with_qk_norm: bool) -> None:
    dev = torch.device("cuda")
    # a 1-layer model for its RoPE tables
    model = LlamaModel(
        dataclasses.replace(C, num_layers=1, vocab_size=16, bos_token_id=1, eos_token_ids=(2,)), dev, dtype
    )
    hq, hkv, d = C.num_heads, C.num_kv_heads, C.head_dim
    qkv = torch.randn(n_tokens, (hq + 2 * hkv) * d, device=dev).to(dtype)
    positions = torch.randint(0, C.max_position_embeddings, (n_tokens,), device=dev)
    slots = torch.randperm(64 * 16, device=dev)[:n_tokens]
    slots[0] = -1
    kv = torch.zeros(2, 64, 16, hkv, d, device=dev, dtype=dtype)
    meta = AttentionMetadata(  # n_tokens one-token sequences: what RoPE + KV write read
        positions=positions,
        slot_mapping=slots,
        query_start_loc=torch.arange(n_tokens + 1, dtype=torch.int32, device=dev),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=torch.zeros(n_tokens, C.max_position_embeddings // 16, dtype=torch.int32, device=dev),
        max_query_len=1,
        max_seq_len=C.max_position_embeddings,
        rope=model.rope,
    )
    kv_ref, qkv_ref = kv.clone(), qkv.clone()
    weights = (torch.rand(d, device=dev).to(dtype) + 0.5, torch.rand(d, device=dev).to(dtype) + 0.5)
    qk_norm = QKNorm(*weights, 1e-6) if with_qk_norm else None
    q = TRI.rope_write_kv(qkv, kv, meta, hq, qk_norm)
    q_ref = REF.rope_write_kv(qkv_ref, kv_ref, meta, hq, qk_norm)
    _ulp_close(q, q_ref)
    _ulp_close(kv, kv_ref)
    gate_up = torch.randn(n_tokens, 2 * C.intermediate_size, device=dev).to(dtype) * 4
    _ulp_close(TRI.silu_mul(gate_up), REF.silu_mul(gate_up))


def test_split_prefill_of_a_short_suffix_over_a_long_prefix_on_gpu() -> None:
    """A fetched 16k prefix's 16-token step takes the split-K path, alone and beside a sequence whose
    40 new tokens cross a query tile's causal edge; bf16 at Llama-3.1-8B's attention shape."""
    from pdserve.benchmarks.kernels_gpu import paged_batch

    dev = torch.device("cuda")
    specs = [(16384, 16), (3000, 40)]
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    q, kv, meta = paged_batch(specs, C.num_heads, C.num_kv_heads, C.head_dim, 16, torch.bfloat16, dev)
    assert choose_prefill_splits(C.num_heads, 2, 40, 16400, sm_count) > 1
    scale = C.head_dim**-0.5
    got, want = TRI.prefill_attention(q, kv, meta, scale), REF.prefill_attention(q, kv, meta, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _kernel_names(fn: object) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name]


def test_captured_decode_step_launches_few_kernels() -> None:
    """A batch-1 decode step on a 2-layer model: per layer 4 matrix products (+ split-K reduces), SiLU x up
    in the gate+up GEMV's epilogue, and 4 kernels of ours (2 norms, RoPE + KV write, attention with its
    splits reduced in the same launch), plus our fused final norm (compute_logits gets the step's ops).
    Besides those, only the embedding, the last residual add, the logits cast and the runner's copy of the
    logits: 4, and 10 allowed."""
    dev = torch.device("cuda")
    cfg = dataclasses.replace(C, num_layers=2, vocab_size=512, bos_token_id=1, eos_token_ids=(2,))
    model = LlamaModel(cfg, dev, torch.bfloat16)
    fill_dummy_weights(model, seed=1)
    tok = Tokenizer.byte_level(cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    loaded = LoadedModel(cfg, model.eval(), tok, b"tiny8b", "dummy:tiny8b")
    engine_cfg = EngineConfig(model="dummy:tiny8b", device="cuda", dtype="bfloat16", max_num_seqs=1)
    runner = ModelRunner(loaded, engine_cfg, 16, max_model_len=256)
    assert runner.graphs is not None
    item = BatchItem(list(range(40)), 39, 1, [3, 5, 7], True)
    runner.execute([BatchItem(list(range(40)), 0, 39, [3, 5, 7], True)])
    names = _kernel_names(lambda: runner.execute([item]))
    runner.close()
    ours = [
        n
        for n in names
        if re.match(r"_(rms_norm|rope_write_kv|silu_mul|decode_split|reduce_splits)_kernel", n)
    ]
    assert len(ours) == 2 * 4 + 1 and "_silu_mul_kernel" not in names, names
    assert "_reduce_splits_kernel" not in names, names
    assert names.count("_gemv_kernel") == 2 * 4 + 1, names  # the LM head's too
    gemm = re.compile(r"gemm|gemv|nvjet|splitK|cutlass|sm90_xmma", re.IGNORECASE)
    others = [n for n in names if n not in ours and not gemm.search(n)]
    assert len(others) <= 10, others
