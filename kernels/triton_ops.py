"""Triton implementation of `AttentionOps` (kernels/ops.py), checked against kernels/reference.py.

Owns the block gather/scatter kernel and the boundary checks of every op; the attention kernels live in
kernels/triton_attention.py, the fused norm/RoPE/SiLU kernels (the KV-cache write among them) in
kernels/triton_fused.py. Invariants: every op checks shapes, dtypes, strides and devices before launching
(nothing device-specific is read at import), and no op reads a device value on the host, so decode stays
capturable in a CUDA graph. Under TRITON_INTERPRET=1 the same
kernels run on CPU tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from pdserve.kernels import triton_fused
from pdserve.kernels.ops import FP8_KV_DTYPES, AttentionMetadata, QKNorm, check_kv_layer
from pdserve.kernels.triton_attention import (
    choose_num_splits,
    choose_prefill_splits,
    paged_decode_attention,
    paged_prefill_attention,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = (*_FLOAT_DTYPES, *FP8_KV_DTYPES)  # an FP8 cache: kernels/ops.py
_INTERPRETER_SM_COUNT = 4  # CPU tensors only run under the interpreter; a few splits keep it exercised
_COPY_CHUNK = 1024  # elements per program of a block copy


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr, src_kv_stride, dst_kv_stride,
    BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    block = tl.load(ids_ptr + i)  # int64
    # A block is BLOCK_ELEMS contiguous elements on both sides; gather reads block ids, scatter writes them.
    src_block = block if GATHER else i.to(tl.int64)
    dst_block = i.to(tl.int64) if GATHER else block
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    x = tl.load(src_ptr + kv * src_kv_stride + src_block * BLOCK_ELEMS + offs, mask=mask)
    tl.store(dst_ptr + kv * dst_kv_stride + dst_block * BLOCK_ELEMS + offs, x, mask=mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


class TritonOps:
    """`AttentionOps` with Triton kernels. Stateless apart from a per-device SM-count cache."""

    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]; causal over each sequence's paged context (varlen batch).

        Splits each sequence's keys (choose_prefill_splits, from the host ints max_query_len and
        max_seq_len) when a short suffix over a long context would leave SMs idle.
        """
        _check_attention(q, kv_layer, meta)
        assert meta.query_start_loc.shape == (meta.num_seqs + 1,), (
            f"query_start_loc must be [S+1] = [{meta.num_seqs + 1}], got {tuple(meta.query_start_loc.shape)}"
        )
        num_splits = choose_prefill_splits(
            q.shape[1], meta.num_seqs, meta.max_query_len, meta.max_seq_len, _sm_count(kv_layer.device)
        )
        return paged_prefill_attention(
            q, kv_layer, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
            num_splits,
        )  # fmt: skip

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [S, Hq, D] (one token per sequence) -> [S, Hq, D].

        The split count follows meta.max_seq_len (a host int): a CUDA graph captured at a given
        max_seq_len stays correct for every batch whose contexts are no longer than it.
        """
        _check_attention(q, kv_layer, meta)
        assert q.shape[0] == meta.num_seqs, (
            f"decode q must be [S={meta.num_seqs}, Hq, D], got {tuple(q.shape)}"
        )
        num_splits = choose_num_splits(
            meta.num_seqs, kv_layer.shape[3], meta.max_seq_len, _sm_count(kv_layer.device),
            kv_layer.dtype == torch.float8_e4m3fn,
        )  # fmt: skip
        return paged_decode_attention(q, kv_layer, meta.block_tables, meta.seq_lens, scale, num_splits)

    def gather_blocks(self, kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks into a contiguous buffer. block_ids: [n] int64; out: [2, n, block_size, Hkv, D]."""
        _check_cache(kv_layer)
        ids = _block_ids(block_ids, kv_layer.device, kv_layer.shape[1])
        _check_block_buffer("out", out, kv_layer, ids.shape[0])
        assert out.dtype == kv_layer.dtype, (
            f"out dtype {out.dtype} must equal kv_layer dtype {kv_layer.dtype}"
        )
        _copy_blocks(kv_layer, out, ids, gather=True)

    def scatter_blocks(self, src: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Inverse of gather_blocks: src [2, n, block_size, Hkv, D] into the blocks named by block_ids."""
        _check_cache(kv_layer)
        ids = _block_ids(block_ids, kv_layer.device, kv_layer.shape[1])
        _check_block_buffer("src", src, kv_layer, ids.shape[0])
        _copy_blocks(src, kv_layer, ids, gather=False)

    def scatter_layers(self, src: torch.Tensor, kv_layers: torch.Tensor, block_ids: torch.Tensor) -> None:
        """scatter_blocks over consecutive layers in one launch: src [nl, 2, n, block_size, Hkv, D] into
        kv_layers [nl, 2, N, block_size, Hkv, D] (a slice of the layer-stacked cache). A frame of 32 layers is
        one launch, not 32: each costs the receiving host its checks and launch, whatever the bytes."""
        assert kv_layers.dim() == 6 and kv_layers.shape[1] == 2 and kv_layers.is_contiguous(), (
            f"kv_layers must be a contiguous [nl, 2, N, B, Hkv, D], got {tuple(kv_layers.shape)} strides "
            f"{kv_layers.stride()}"
        )
        assert kv_layers.dtype in _CACHE_DTYPES, (
            f"kv_layers dtype must be one of {_CACHE_DTYPES}, got {kv_layers.dtype}"
        )
        ids = _block_ids(block_ids, kv_layers.device, kv_layers.shape[2])
        planes = kv_layers.flatten(0, 1)  # [nl * 2, N, B, Hkv, D], a view
        want = (kv_layers.shape[0], 2, ids.shape[0], *kv_layers.shape[3:])
        assert tuple(src.shape) == want and src.is_contiguous(), (
            f"src must be a contiguous {want}, got {tuple(src.shape)} strides {src.stride()}"
        )
        _check_block_buffer("src", src.flatten(0, 1), planes, ids.shape[0])
        _copy_blocks(src.flatten(0, 1), planes, ids, gather=False)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, E] -> [T, E] in x's dtype: normalised in fp32, rounded, then scaled by weight [E]."""
        _check_rows("x", x, weight)
        return triton_fused.rms_norm(x, None, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, E]. residual += x in place (rounded to its dtype); returns
        (rms_norm(residual), residual)."""
        _check_rows("x", x, weight)
        _check_rows("residual", residual, weight)
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}"
        return triton_fused.rms_norm(x, residual, weight, eps), residual

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        num_heads: int,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """Rotates q (normed first, with `qk_norm`) in place in qkv [T, (Hq + 2 Hkv) * D], writes rotated
        k (normed first) and v to the cache, one launch; returns
        q: [T, Hq, D], a view of qkv. Positions are not range-checked (that would read the device); the
        RoPE tables checked themselves when they were built."""
        _check_cache(kv_layer)
        n_kv, head_dim = kv_layer.shape[3], kv_layer.shape[4]
        width = (num_heads + 2 * n_kv) * head_dim
        assert head_dim % 2 == 0, f"RoPE needs an even head dim, got {head_dim}"
        assert qkv.dim() == 2 and qkv.shape[1] == width, (
            f"qkv must be [T, {width}] for {num_heads} q heads and kv_layer {tuple(kv_layer.shape)}, "
            f"got {tuple(qkv.shape)}"
        )
        _check_float("qkv", qkv, kv_layer.device)
        assert qkv.stride(1) == 1, f"qkv must be contiguous along its columns, got strides {qkv.stride()}"
        n_tokens = qkv.shape[0]
        _check_index("positions", meta.positions, torch.int64, kv_layer.device, (n_tokens,))
        _check_index("slot_mapping", meta.slot_mapping, torch.int64, kv_layer.device, (n_tokens,))
        cos = meta.rope.cos
        assert cos.shape[1] == head_dim // 2 and cos.device == kv_layer.device, (
            f"RoPE tables must be [P, {head_dim // 2}] on {kv_layer.device}, got {tuple(cos.shape)} on "
            f"{cos.device}"
        )
        if qk_norm is not None:
            for name, w in (("q_weight", qk_norm.q_weight), ("k_weight", qk_norm.k_weight)):
                assert w.shape == (head_dim,) and w.is_contiguous() and w.device == qkv.device, (
                    f"qk_norm.{name} must be [{head_dim}] contiguous on {qkv.device}, got {tuple(w.shape)} "
                    f"on {w.device}"
                )
        triton_fused.rope_write_kv(qkv, kv_layer, meta, num_heads, qk_norm)
        return qkv[:, : num_heads * head_dim].view(n_tokens, num_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2F] (gate | up) -> silu(gate) * up: [T, F], silu rounded before the product."""
        assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, (
            f"gate_up must be [T, 2F], got {tuple(gate_up.shape)}"
        )
        assert gate_up.dtype in _FLOAT_DTYPES, (
            f"gate_up dtype must be one of {_FLOAT_DTYPES}, got {gate_up.dtype}"
        )
        assert gate_up.stride(1) == 1, f"gate_up must be contiguous along its columns, got {gate_up.stride()}"
        return triton_fused.silu_mul(gate_up)


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    """src / dst: [P, *, B, Hkv, D] with the same P planes (K and V of one layer or of several)."""
    n = ids.shape[0]
    if n == 0:
        return
    if src.dtype in FP8_KV_DTYPES or dst.dtype in FP8_KV_DTYPES:  # bytes: no conversion on the way
        assert src.dtype == dst.dtype, f"an FP8 cache copies FP8 blocks, got {src.dtype} into {dst.dtype}"
    if src.dtype == dst.dtype:  # moved as the widest words the head dim allows: fewer elements a program
        word = _copy_word(src, dst)
        src, dst = src.view(word), dst.view(word)
    block_elems = src[0, 0].numel()
    _copy_blocks_kernel[(n, src.shape[0], triton.cdiv(block_elems, _COPY_CHUNK))](
        src, dst, ids, src.stride(0), dst.stride(0),
        BLOCK_ELEMS=block_elems, CHUNK=_COPY_CHUNK, GATHER=gather, num_warps=4,
    )  # fmt: skip


def _copy_word(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype whose size divides every tensor's last-dim bytes, offset and strides: a block
    copy moves the same bytes as words, so an FP8 cache (1-byte elements) costs no more instructions per byte
    than a bf16 one."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if all(
            t.stride(-1) == 1 and (t.shape[-1] * t.element_size()) % size == 0
            and all(n * t.element_size() % size == 0 for n in (t.storage_offset(), *t.stride()[:-1]))
            for t in tensors
        ):  # fmt: skip
            return word
    return torch.uint8


def _check_cache(kv_layer: torch.Tensor) -> None:
    check_kv_layer(kv_layer)
    assert kv_layer.dtype in _CACHE_DTYPES, (
        f"kv_layer dtype must be one of {_CACHE_DTYPES}, got {kv_layer.dtype}"
    )


def _check_float(name: str, x: torch.Tensor, device: torch.device) -> None:
    assert x.dtype in _FLOAT_DTYPES, f"{name} dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}"
    assert x.device == device, f"{name} is on {x.device} but kv_layer is on {device}"


def _check_index(
    name: str, x: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]
) -> None:
    assert x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}"
    assert x.device == device, f"{name} is on {x.device} but kv_layer is on {device}"
    assert tuple(x.shape) == shape, f"{name} must have shape {shape}, got {tuple(x.shape)}"
    assert x.dim() == 0 or x.stride(-1) == 1, f"{name} must be contiguous in its last dim, got {x.stride()}"


def _check_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> None:
    _check_cache(kv_layer)
    _, _, block_size, n_kv, head_dim = kv_layer.shape
    assert q.dim() == 3 and q.shape[2] == head_dim, (
        f"q must be [T, Hq, {head_dim}] to match kv_layer {tuple(kv_layer.shape)}, got {tuple(q.shape)}"
    )
    assert q.shape[1] % n_kv == 0, f"query heads {q.shape[1]} must be a multiple of KV heads {n_kv}"
    assert q.stride(2) == 1, f"q must have a contiguous head dim, got strides {q.stride()}"
    _check_float("q", q, kv_layer.device)
    n_seqs = meta.num_seqs
    _check_index("seq_lens", meta.seq_lens, torch.int32, kv_layer.device, (n_seqs,))
    _check_index("query_start_loc", meta.query_start_loc, torch.int32, kv_layer.device, (n_seqs + 1,))
    tables = meta.block_tables
    assert tables.dim() == 2 and tables.shape[0] == n_seqs, (
        f"block_tables must be [S={n_seqs}, max_blocks], got {tuple(tables.shape)}"
    )
    _check_index("block_tables", tables, torch.int32, kv_layer.device, tuple(tables.shape))
    need = -(-meta.max_seq_len // block_size)
    assert tables.shape[1] >= need, (
        f"block_tables has {tables.shape[1]} columns but max_seq_len {meta.max_seq_len} needs {need}"
    )


def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (
        f"{name} must be [T, E] with weight [E], got {tuple(x.shape)} and weight {tuple(weight.shape)}"
    )
    assert x.dtype in _FLOAT_DTYPES, f"{name} dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}"
    assert x.device == weight.device, f"{name} is on {x.device} but the weight is on {weight.device}"
    assert weight.dtype == x.dtype, f"{name} dtype {x.dtype} must equal the weight's {weight.dtype}"
    assert x.stride(1) == 1 and weight.stride(0) == 1, (
        f"{name} and weight must be contiguous along E, got strides {x.stride()} and {weight.stride()}"
    )


def _block_ids(block_ids: torch.Tensor, device: torch.device, num_blocks: int) -> torch.Tensor:
    assert block_ids.dim() == 1, f"block_ids must be [n], got {tuple(block_ids.shape)}"
    assert not block_ids.is_floating_point(), f"block_ids must be integers, got {block_ids.dtype}"
    if block_ids.device.type == "cpu" and block_ids.numel() > 0:
        # Host ids (transfer descriptors) are range-checked for free; device ids would need a sync.
        lo, hi = int(block_ids.min()), int(block_ids.max())
        assert lo >= 0 and hi < num_blocks, f"block_ids must lie in [0, {num_blocks}), got [{lo}, {hi}]"
    return block_ids.to(device=device, dtype=torch.int64).contiguous()


def _check_block_buffer(name: str, buf: torch.Tensor, kv_layer: torch.Tensor, n: int) -> None:
    want = (kv_layer.shape[0], n, *kv_layer.shape[2:])
    assert tuple(buf.shape) == want, f"{name} must be {want}, got {tuple(buf.shape)}"
    assert buf.is_contiguous(), f"{name} must be contiguous, got strides {buf.stride()}"
    assert buf.dtype in _CACHE_DTYPES, f"{name} dtype must be one of {_CACHE_DTYPES}, got {buf.dtype}"
    assert buf.device == kv_layer.device, f"{name} is on {buf.device} but kv_layer is on {kv_layer.device}"
