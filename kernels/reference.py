"""Torch reference ops: the oracle for the Triton kernels and the CPU implementation.

Same signatures as `AttentionOps` (kernels/ops.py). Decode attention is batched over sequences (one
padded gather per layer, one fused SDPA call) because it runs every step; prefill loops over sequences
because it is compute-bound and its sequences differ in length, each through torch's fused CPU flash
kernel (`_attend`). The elementwise ops round where Hugging Face's Llama does (RMSNorm in fp32, rounded
before the weight); RoPE runs in fp32 and is rounded once, which in fp32 is Hugging Face's computation
exactly. On the CPU they are memory-bound passes over [T, E]-sized tensors, so each writes into the
buffer it allocated (no concatenation, no copy back into qkv), and RoPE leaves q head-major, the layout the
flash kernel reads; an FP8 cache is written through `to_kv` and read through
`from_kv` (kernels/ops.py); torch's CPU kernels copy float8 tensors only as bytes (index_copy_ has no
float8 kernel), so writes go through uint8 views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pdserve.kernels.ops import AttentionMetadata, QKNorm, check_kv_layer, from_kv, to_kv


class ReferenceOps:
    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        check_kv_layer(kv_layer)
        starts = meta.query_start_loc.tolist()
        lens = meta.seq_lens.tolist()
        if len(lens) == 1 and starts[1] == q.shape[0]:  # a lone chunk with no padding rows: the whole result
            k, v = _context(kv_layer, meta.block_tables[0], lens[0], q.dtype)
            return _attend(q, k, v, lens[0] - q.shape[0], scale)
        out = torch.empty_like(q)
        for s, seq_len in enumerate(lens):
            q0, q1 = starts[s], starts[s + 1]
            if q1 == q0:
                continue
            k, v = _context(kv_layer, meta.block_tables[s], seq_len, q.dtype)
            out[q0:q1] = _attend(q[q0:q1], k, v, seq_len - (q1 - q0), scale)
        return out

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        check_kv_layer(kv_layer)
        n_seqs, n_heads, head_dim = q.shape
        assert n_seqs == meta.num_seqs, (q.shape, meta.num_seqs)
        block_size, n_kv = kv_layer.shape[2], kv_layer.shape[3]
        n_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :n_blocks].long()
        # k, v: [S, Hkv, L, D] with L = n_blocks * block_size
        k = from_kv(kv_layer[0][tables], q.dtype).flatten(1, 2).transpose(1, 2)
        v = from_kv(kv_layer[1][tables], q.dtype).flatten(1, 2).transpose(1, 2)
        pos = torch.arange(n_blocks * block_size, device=q.device)
        mask = pos[None, :] < meta.seq_lens[:, None].to(q.device)  # [S, L]
        out = F.scaled_dot_product_attention(
            q.view(n_seqs, n_heads, 1, head_dim).to(k.dtype),  # [S, Hq, 1, D]
            k,
            v,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=n_heads != n_kv,
        )  # [S, Hq, 1, D]
        return out.view(n_seqs, n_heads, head_dim).to(q.dtype)

    def gather_blocks(self, kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        check_kv_layer(kv_layer)
        assert out.shape == (2, block_ids.shape[0], *kv_layer.shape[2:]), (out.shape, kv_layer.shape)
        torch.index_select(kv_layer, 1, block_ids.to(kv_layer.device, torch.int64), out=out)

    def scatter_blocks(self, src: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
        check_kv_layer(kv_layer)
        assert src.shape == (2, block_ids.shape[0], *kv_layer.shape[2:]), (src.shape, kv_layer.shape)
        ids = block_ids.to(kv_layer.device, torch.int64)
        kv_layer.view(torch.uint8).index_copy_(1, ids, src.to(kv_layer.dtype).view(torch.uint8))

    def scatter_layers(self, src: torch.Tensor, kv_layers: torch.Tensor, block_ids: torch.Tensor) -> None:
        assert kv_layers.dim() == 6 and kv_layers.shape[1] == 2, (
            f"kv_layers must be [nl,2,N,B,H,D], got {kv_layers.shape}"
        )
        assert src.shape == (kv_layers.shape[0], 2, block_ids.shape[0], *kv_layers.shape[3:]), (
            src.shape,
            kv_layers.shape,
        )
        ids = block_ids.to(kv_layers.device, torch.int64)
        kv_layers.view(torch.uint8).index_copy_(2, ids, src.to(kv_layers.dtype).view(torch.uint8))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # [T, E], a new tensor
        return normed.mul_(weight)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.shape == residual.shape, (x.shape, residual.shape)
        residual.add_(x)
        return self.rms_norm(residual, weight, eps), residual

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        num_heads: int,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        check_kv_layer(kv_layer)
        n_tokens = qkv.shape[0]
        n_kv, head_dim = kv_layer.shape[3], kv_layer.shape[4]
        q_cols = num_heads * head_dim
        assert qkv.shape[1] == q_cols + 2 * n_kv * head_dim, (qkv.shape, num_heads, kv_layer.shape)
        qk = qkv[:, : q_cols + n_kv * head_dim].view(n_tokens, num_heads + n_kv, head_dim)
        if qk_norm is not None:  # a normed copy: qkv's k columns stay as they were
            normed = F.rms_norm(qk.float(), (head_dim,), eps=qk_norm.eps).to(qkv.dtype)  # [T, Hq + Hkv, D]
            qk = torch.cat(
                (normed[:, :num_heads] * qk_norm.q_weight, normed[:, num_heads:] * qk_norm.k_weight), 1
            )
        half = head_dim // 2
        rope, positions = meta.rope, meta.positions
        c, s = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)  # [T, 1, D/2] fp32
        x1, x2 = qk[..., :half], qk[..., half:]  # [T, Hq + Hkv, D/2] each, views of qkv (or the normed copy)
        # rotated: [T, Hq + Hkv, D] fp32, laid out head-major ([H, T, D] in memory), so q's heads reach the
        # flash kernel contiguous; each half is written in place, with HF's roundings (x1 c - x2 s, ...)
        rotated = torch.empty((num_heads + n_kv, n_tokens, head_dim), dtype=torch.float32, device=qkv.device)
        rotated = rotated.transpose(0, 1)
        r1, r2 = rotated[..., :half], rotated[..., half:]
        torch.mul(x1, c, out=r1).sub_(x2 * s)
        torch.mul(x2, c, out=r2).add_(x1 * s)
        rotated = rotated.to(qkv.dtype)  # no copy in fp32; keeps the head-major layout otherwise
        v = qkv[:, q_cols + n_kv * head_dim :].view(n_tokens, n_kv, head_dim)  # v: [T, Hkv, D]
        write_kv(rotated[:, num_heads:], v, kv_layer, meta.slot_mapping)
        return rotated[:, :num_heads]  # q: [T, Hq, D]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        f = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :f]).mul_(gate_up[:, f:])  # silu's output is new: multiplied in place


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [T, Hkv, D]; writes token t into slot slot_mapping[t] of kv_layer (skips -1): the second
    half of `rope_write_kv`, and how tests fill a cache."""
    check_kv_layer(kv_layer)
    _, n_blocks, block_size, n_kv, head_dim = kv_layer.shape
    assert key.shape == value.shape and key.shape[1:] == (n_kv, head_dim), (key.shape, kv_layer.shape)
    assert slot_mapping.shape == (key.shape[0],)
    flat = kv_layer.view(2, n_blocks * block_size, n_kv, head_dim)
    if bool((slot_mapping < 0).any()):  # padding rows (slot -1) are rare: mask only then
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    raw = flat.view(torch.uint8)
    raw[0].index_copy_(0, slot_mapping, to_kv(key, kv_layer.dtype).view(torch.uint8))
    raw[1].index_copy_(0, slot_mapping, to_kv(value, kv_layer.dtype).view(torch.uint8))


def _context(
    kv_layer: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V, [seq_len, Hkv, D] each, gathered in one copy from its block-table row (an FP8
    cache's widened to `dtype`)."""
    n_blocks = -(-seq_len // kv_layer.shape[2])
    kv = kv_layer[:, table[:n_blocks].long()].flatten(1, 2)[:, :seq_len]  # [2, seq_len, Hkv, D]
    kv = from_kv(kv, dtype)
    return kv[0], kv[1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D] at positions q_offset.. ; k, v: [Lk, Hkv, D] with Lk = q_offset + Lq -> [Lq, Hq, D],
    causal, GQA.

    On the CPU, always torch's fused flash kernel: it needs 4-D inputs (3-D ones fall to the math path, which
    materializes every head's [Lq, Lk] scores) and skips the masked half only under `is_causal`, whose
    diagonal is top-left. So a chunk after a cached prefix is two flash calls, the new tokens over the
    prefix (no mask) and over themselves (causal), merged by their log-sum-exps: exact, and no score the
    causal mask drops is computed."""
    n_q, n_k = q.shape[0], k.shape[0]
    assert n_k == q_offset + n_q, (q.shape, k.shape, q_offset)
    qh = q.transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, Lq, D]
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
    if q_offset == 0 or n_q == 1:  # a fresh prompt; or one token, which sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n_q > 1, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)
    if qh.device.type != "cpu":  # the reference on a GPU (tests, benchmarks' checks): one masked call
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=qh.device).tril(
            q_offset
        )  # key j <= q_offset + i
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    old, old_lse = flash(qh, kh[:, :, :q_offset], vh[:, :, :q_offset], 0.0, False, scale=scale)
    new, new_lse = flash(qh, kh[:, :, q_offset:], vh[:, :, q_offset:], 0.0, True, scale=scale)
    # old, new: [1, Hq, Lq, D]; *_lse: [1, Hq, Lq] fp32; each part's weight is its share of the softmax mass
    w_old = torch.sigmoid(old_lse - new_lse).unsqueeze(-1)  # [1, Hq, Lq, 1]
    out = torch.lerp(new.float(), old.float(), w_old)  # new + w_old * (old - new)
    return out[0].transpose(0, 1).to(q.dtype)
