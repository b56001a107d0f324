"""Every Triton kernel compiles for sm_90 (H100/H200) on a machine without a GPU.

The interpreter (tests/test_triton_kernels.py) checks numerics but not what only the compiler rejects
(non-constexpr globals, dot shapes, layouts, shared memory). Each case compiles the variant its launch on
the GPU compiles: Triton's own argument binder specialises the launch's values (aligned pointers and strides
that divide by 16 become vector loads and cp.async pipelines; without that every load is scalar), and the
shared memory is checked against sm_90's limit, which only the launch would enforce. Compiling needs the
kernels decorated without TRITON_INTERPRET, so it runs in a child process with that variable removed.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled") == len(_cases()), done.stdout


def _cases() -> list[tuple[str, str, dict[str, object]]]:
    """(module, kernel, argument -> "*dtype" for a tensor, else its launch value or constexpr value),
    Llama-3.1-8B shapes; scalars not named come from _LAUNCH_VALUES; "_options": the compile options where
    they are not 4 warps and 2 stages."""
    import triton.language as tl

    attn, ops = "pdserve.kernels.triton_attention", "pdserve.kernels.triton_ops"
    cases: list[tuple[str, str, dict[str, object]]] = []
    # (q/out dtype, KV cache dtype, dot dtype): an FP8 cache (KV_FP8) is read beside a bf16 q
    for act, cache, dot in (("bf16", "bf16", tl.bfloat16), ("fp16", "fp16", tl.float16),
                            ("fp32", "fp32", tl.float32), ("bf16", "fp8e4nv", tl.float16),
                            ("fp32", "fp8e4nv", tl.float32)):  # fmt: skip
        ptrs = {"q_ptr": f"*{act}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "out_ptr": f"*{act}"}
        fp8 = cache == "fp8e4nv"  # ASM_CVT as on the GPU, beside a fp32 q too (then fp32 dots)
        common = {"DOT_DTYPE": dot, "HEAD_DIM": 128, "DIM_PAD": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
                  "KV_FP8": fp8, "ASM_CVT": fp8}  # fmt: skip
        # the decode step's kernels with programmatic dependent launch (kernels/pdl.py), as on sm_90+
        decode = {**ptrs, **common, "tickets_ptr": "*i32", "GROUP": 4, "GROUP_PAD": 16, "NUM_SPLITS": 3,
                  "ONE_LAUNCH": False, "GROUP_R": 4, "SPLITS_PAD": 4, "R_CHUNK": 2, "PDL": True}  # fmt: skip
        cases.append((attn, "_decode_split_kernel", decode))
        # a tile inside one 64-token page: 32 keys; for FP8 compiled as _DECODE_TILES runs it (16 keys, one
        # warp, 5 stages)
        tile = {"BLOCK_N": 32, "BLOCK_SIZE": 64, "_options": {}}
        if fp8:
            tile = {"BLOCK_N": 16, "BLOCK_SIZE": 64, "_options": {"num_warps": 1, "num_stages": 5}}
        cases.append((attn, "_decode_split_kernel", {**decode, **tile}))
        # one launch (the last split reduces), at batch 1's 32 splits of an 8k graph
        one = {"ONE_LAUNCH": True, "NUM_SPLITS": 32, "SPLITS_PAD": 32, "R_CHUNK": 2 if fp8 else 8}
        cases.append((attn, "_decode_split_kernel", {**decode, **tile, **one}))
        # one launch over one split: the output stored directly, no partials, no ticket
        one_split = {"ONE_LAUNCH": True, "NUM_SPLITS": 1, "SPLITS_PAD": 1, "R_CHUNK": 1}
        cases.append((attn, "_decode_split_kernel", {**decode, **one_split}))
        for split in (False, True):
            prefill = {**ptrs, **common, "GROUP": 4, "BLOCK_M": 64, "SPLIT": split}
            cases.append((attn, "_prefill_kernel", prefill))
    cases.append((attn, "_reduce_splits_kernel", {"out_ptr": "*bf16", "HEAD_DIM": 128, "DIM_PAD": 128,
                                                  "SPLITS_CHUNK": 16, "PDL": True}))  # fmt: skip
    # RoPE + the KV-cache write (FP8: saturated), Qwen3's q/k norm first or not
    for cache, sat, norm in (("bf16", 0.0, False), ("bf16", 0.0, True), ("fp8e4nv", 448.0, True)):
        cases.append(("pdserve.kernels.triton_fused", "_rope_write_kv_kernel", {
            "qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "slots_ptr": "*i64", "qw_ptr": "*bf16",
            "kw_ptr": "*bf16", "N_Q": 32, "N_KV": 8, "HALF": 64, "Q_PAD": 32, "KV_PAD": 8,
            "HALF_PAD": 64, "SAT": sat, "QK_NORM": norm, "PDL": True}))  # fmt: skip
    for residual in (False, True):
        cases.append(("pdserve.kernels.triton_fused", "_rms_norm_kernel", {
            "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "HAS_RESIDUAL": residual, "BLOCK": 4096, "PDL": True, "_options": {"num_warps": 8}}))  # fmt: skip
    cases.append(("pdserve.kernels.triton_fused", "_silu_mul_kernel", {
        "gate_up_ptr": "*bf16", "out_ptr": "*bf16", "BLOCK": 1024, "PDL": True}))  # fmt: skip
    for gather in (True, False):
        copy = {"src_ptr": "*bf16", "dst_ptr": "*bf16", "ids_ptr": "*i64", "BLOCK_ELEMS": 16384,
                "CHUNK": 1024, "GATHER": gather}  # fmt: skip
        cases.append((ops, "_copy_blocks_kernel", copy))
    # (activation dtype, weight dtype, dot dtype): FP8 weights with a row scale beside bf16 activations
    for dtype, weight, dot in (("bf16", "bf16", tl.bfloat16), ("fp32", "fp32", tl.float32),
                               ("bf16", "fp8e4nv", tl.bfloat16)):  # fmt: skip
        # (rows, block_n, block_k, one fp32 tile summed over the K steps); GLU: gate+up with SiLU x up
        # 64 rows (batched decode, where the table says the GEMV beat cuBLAS): x padded to 64 rows
        gemv_tiles = ((1, 2, 4096, False), (1, 2, 1024, True), (16, 32, 256, False), (64, 64, 128, False))
        # PREFETCH: the first weight tile prefetched into L2 before the grid dependency wait
        for (rows, block_n, block_k, acc_2d), split, glu in itertools.product(
            gemv_tiles, (False, True), (False, True)
        ):
            ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{weight}", "b_ptr": f"*{dtype}", "s_ptr": "*fp32",
                    "y_ptr": f"*{dtype}", "p_ptr": "*fp32" if split else f"*{dtype}"}  # fmt: skip
            gemv = {"HAS_BIAS": rows == 1 and not glu, "HAS_SCALE": weight == "fp8e4nv", "M": rows,
                    "M_PAD": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "DOT_DTYPE": dot, "SPLIT": split,
                    "GLU": glu,
                    "ACC_2D": acc_2d, "ACC_G": 4 if acc_2d and weight == "fp8e4nv" else 1,
                    "PDL": True, "PREFETCH": split != glu, "LINE": 128 if weight == "fp8e4nv" else 64,
                    "W_VEC": 8 if weight == "fp8e4nv" and glu else 0}  # fmt: skip
            cases.append(("pdserve.kernels.triton_gemv", "_gemv_kernel", {**ptrs, **gemv}))
        for glu in (False, True):
            reduce = {"p_ptr": "*fp32", "b_ptr": f"*{dtype}", "s_ptr": "*fp32", "y_ptr": f"*{dtype}",
                      "HAS_BIAS": not glu, "HAS_SCALE": weight == "fp8e4nv", "GLU": glu,
                      "BLOCK": 256, "PDL": True}  # fmt: skip
            cases.append(("pdserve.kernels.triton_gemv", "_splitk_reduce_kernel", reduce))
    # the MoE experts' two grouped GEMMs, at the decode and the prefill tiles (choose_tiles)
    moe = "pdserve.kernels.triton_moe"
    pairs = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i64"}
    for block_m, block_k in ((16, 128), (64, 64)):
        tiles = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "DOT_DTYPE": tl.bfloat16,
                 "_options": {"num_stages": 3}}  # fmt: skip
        gate_up = {"x_ptr": "*bf16", "w_ptr": "*bf16", "act_ptr": "*bf16", **pairs, **tiles}
        cases.append((moe, "_gate_up_kernel", gate_up))
        down = {"act_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "weights_ptr": "*fp32"}
        cases.append((moe, "_down_kernel", {**down, **pairs, **tiles}))
    # the few-pairs decode path at qwen3-30b-a3b's shape (E 2048, F 768, 128 experts, top 8): default tiles
    dec = "pdserve.kernels.triton_moe_decode"
    routing = {"ids_ptr": "*i64", "weights_ptr": "*fp32"}
    route = {"logits_ptr": "*bf16", **routing, "TOP_K": 8, "K_PAD": 8, "X_PAD": 128, "RENORMALIZE": True,
             "PDL": True, "_options": {"num_warps": 1}}  # fmt: skip
    cases.append((dec, "_route_kernel", route))
    for dtype in ("bf16", "fp32"):
        cases.append((dec, "_gate_up_gemv_kernel", {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
                                                    "act_ptr": f"*{dtype}", "ids_ptr": "*i64",
                                                    "BLOCK_N": 1, "BLOCK_K": 1024, "PDL": True}))  # fmt: skip
        cases.append((dec, "_down_sum_kernel", {"act_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
                                                "out_ptr": f"*{dtype}", **routing, "TOP_K": 8, "K_PAD": 8,
                                                "BLOCK_N": 2, "BLOCK_K": 256, "PDL": True,
                                                "_options": {"num_warps": 8}}))  # fmt: skip
    return cases


# Pointers a case does not name (as "*dtype"); its other runtime arguments come from _LAUNCH_VALUES.
_RUNTIME_DEFAULTS = {
    "tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_ptr": "*i32",
    "mid_o_ptr": "*fp32",
    "mid_lse_ptr": "*fp32",
}

# The scalars each launch passes, at the shapes above (Llama-3.1-8B: E 4096, 32 q / 8 KV heads of 128,
# F 14336, a [blocks, 16, 8, 128] cache, page tables of 512 entries; Qwen3-30B-A3B experts: E 2048, F 768,
# top 8). The launcher specialises on their values: a multiple of 16 gets tt.divisibility (vector loads), a 1
# becomes a constant; a case overrides one where its launch differs (the GEMV's M at batch 1 / 16 / 64).
# fmt: off
_LAUNCH_VALUES: dict[str, dict[str, object]] = {
    "_decode_split_kernel": {"qk_scale": 0.1275, "stride_qs": 6144, "stride_qh": 128, "stride_kb": 16384,
                             "stride_kt": 1024, "stride_kh": 128, "stride_ts": 512, "stride_os": 4096,
                             "stride_oh": 128},
    "_prefill_kernel": {"qk_scale": 0.1275, "stride_qt": 6144, "stride_qh": 128, "stride_kb": 16384,
                        "stride_kt": 1024, "stride_kh": 128, "stride_ts": 512, "stride_ot": 4096,
                        "stride_oh": 128, "num_splits": 4},
    "_reduce_splits_kernel": {"stride_or": 4096, "stride_oh": 128, "num_splits": 32},
    "_rope_write_kv_kernel": {"eps": 1e-6, "stride_t": 6144, "stride_cos": 64, "stride_cslot": 1024,
                              "stride_ch": 128},
    "_rms_norm_kernel": {"stride_x": 4096, "stride_r": 4096, "stride_o": 4096, "n_cols": 4096, "eps": 1e-5},
    "_silu_mul_kernel": {"stride_in": 28672, "stride_out": 14336, "n_cols": 14336},
    # a plane of 2^31 words or more, as a whole cache's can be: i64 strides
    "_copy_blocks_kernel": {"src_kv_stride": 3 << 30, "dst_kv_stride": 3 << 30},
    "_gemv_kernel": {"M": 1, "N": 6144, "K": 4096, "K_SPLIT": 2048, "stride_xm": 4096, "stride_wn": 4096,
                     "stride_ym": 6144},
    "_splitk_reduce_kernel": {"M": 1, "N": 6144, "SPLITS": 2, "stride_ym": 6144},
    "_gate_up_kernel": {"n_pairs": 512, "top_k": 8, "F": 768, "K": 2048, "stride_xm": 2048,
                        "stride_we": 3145728, "stride_wn": 2048, "stride_am": 768},
    "_down_kernel": {"n_pairs": 512, "N": 2048, "K": 768, "stride_am": 768, "stride_we": 1572864,
                     "stride_wn": 768, "stride_om": 2048},
    "_route_kernel": {"X": 128, "stride_lt": 128},
    "_gate_up_gemv_kernel": {"top_k": 8, "F": 768, "K": 2048, "stride_xm": 2048, "stride_we": 3145728,
                             "stride_wn": 2048, "stride_am": 768},
    "_down_sum_kernel": {"N": 2048, "K": 768, "stride_am": 768, "stride_we": 1572864, "stride_wn": 768,
                         "stride_om": 2048},
}
# fmt: on

# sm_90's largest opt-in shared memory a block (227 KiB): the launch, not the compiler, rejects more, so the
# test checks it here.
_SM90_MAX_SHARED = 232448


def _compile_all() -> None:
    """Compiles each case as its launch would: Triton's own argument binder specialises the case's values
    (16-byte aligned tensors, as the caching allocator gives, and _LAUNCH_VALUES), then triton.compile."""
    import importlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "fp8e4nv": torch.float8_e4m3fn, "i32": torch.int32, "i64": torch.int64}  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    for module, name, given in _cases():
        fn = getattr(importlib.import_module(module), name)
        values = {**_RUNTIME_DEFAULTS, **_LAUNCH_VALUES[name], **given}
        args: dict[str, object] = {}
        for param in fn.params:
            value = values[param.name]
            if isinstance(value, str) and value.startswith("*"):
                value = torch.empty(16, dtype=dtypes[value[1:]])  # data_ptr() 64-byte aligned
            args[param.name] = value
        tensors = [i for i, p in enumerate(fn.params) if isinstance(args[p.name], torch.Tensor)]
        extra = given.get("_options", {})  # a case's own num_warps / num_stages
        assert isinstance(extra, dict)
        launch = {"num_warps": 4, "num_stages": 2, "launch_pdl": bool(given.get("PDL", False)), **extra}
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, kwargs = binder(**args, **launch)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, kwargs)
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=target, options=options.__dict__)
        shared = kernel.metadata.shared
        assert shared <= _SM90_MAX_SHARED, f"{name} {given}: {shared} B of shared memory > {_SM90_MAX_SHARED}"
        assert all(attrs[(i,)] for i in tensors), f"{name}: a tensor argument compiled without its alignment"
        aligned = sum(1 for attr in attrs.values() if attr)
        print(f"compiled {name} {given.get('DOT_DTYPE', '')} shared={shared} divisible_args={aligned}")


if __name__ == "__main__":
    _compile_all()
