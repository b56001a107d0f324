"""Reading a GGUF file: `ModelConfig` from its metadata, and lazily dequantized HF-named weights.

The header (metadata and tensor table) is gguf_header.py's. Weights are zero-copy views of the mmap,
dequantized only when the model asks (so at most one fp32 tensor exists beside the model):
F32/F16/BF16/Q8_0/Q4_0/Q4_1 in torch, bit-identical to `gguf.quants`, any other type through
`gguf.quants.dequantize`. llama.cpp stores Llama's Q/K rows permuted for its interleaved RoPE;
`_unpermute` restores the Hugging Face order. A tensor-parallel rank dequantizes a whole tensor and keeps its
slice (one whole tensor at a time: slicing the quantized blocks first, per type, is left for later). The
identity is SHA-256 over the bytes before the tensor data (header, metadata, tensor table) and the file
size: no pass over the weights."""

from __future__ import annotations

import hashlib
import mmap
import re
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from pdserve.shared.model.gguf_header import GGUFHeader, GGUFTensor, parse_header
from pdserve.shared.model.model import rope_inv_freq
from pdserve.shared.model.model_config import ModelConfig, RopeScaling
from pdserve.shared.model.parallel import RowSlice, narrow

WeightThunks = dict[str, Callable[[RowSlice | None], torch.Tensor]]
Q = GGMLQuantizationType

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp writes Llama 3.1's scaling as a rope_freqs tensor; these are the values it was made from
_LLAMA3_DEFAULTS = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face name. ValueError for a name this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this loader")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_gguf(path: str) -> tuple[ModelConfig, WeightThunks, bytes]:
    """(config, {HF name: thunk returning the tensor}, weights identity). Raises ValueError or OSError."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view: torch wants one
    header = parse_header(buf)
    if header.data_start + sum(t.nbytes for t in header.tensors.values()) > len(buf):
        raise ValueError(f"file is truncated: {len(buf)} bytes, tensor table needs more")
    identity = hashlib.sha256(
        b"pdserve-gguf-v1\0" + buf[: header.data_start] + len(buf).to_bytes(8, "little")
    )
    config = _config(header, buf)
    permute = config.architecture == "llama"
    thunks: WeightThunks = {}
    for name, t in header.tensors.items():
        if name == "rope_freqs.weight":
            continue
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(name.split(".")[-2], 0)
        thunks[hf_name(name)] = _thunk(buf, t, heads if permute else 0)
    return config, thunks, identity.digest()


def _thunk(buf: mmap.mmap, t: GGUFTensor, unpermute_heads: int) -> Callable[[RowSlice | None], torch.Tensor]:
    def load(part: RowSlice | None) -> torch.Tensor:
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=t.nbytes, offset=t.start)
        w = dequantize_tensor(raw, t.qtype, t.shape)
        return narrow(_unpermute(w, unpermute_heads) if unpermute_heads else w, part)

    return load


def dequantize_tensor(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: [nbytes] uint8 -> float tensor of `shape` (F16/BF16 stay in their type; the rest fp32)."""
    if qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[qtype]).reshape(shape)
    if qtype == Q.Q8_0:
        blocks = raw.view(-1, 34)
        d = blocks[:, :2].view(torch.float16).float()  # d: [n, 1]
        return (blocks[:, 2:].view(torch.int8).float() * d).reshape(shape)
    if qtype in (Q.Q4_0, Q.Q4_1):
        head = 2 if qtype == Q.Q4_0 else 4
        blocks = raw.view(-1, head + 16)
        d = blocks[:, :2].view(torch.float16).float()  # d: [n, 1]
        qs = blocks[:, head:]  # qs: [n, 16]; low nibbles are elements 0..15, high ones 16..31
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1)  # q: [n, 32] uint8
        if qtype == Q.Q4_0:
            return (d * (q.to(torch.int8) - 8).float()).reshape(shape)
        m = blocks[:, 2:4].view(torch.float16).float()  # m: [n, 1]
        return (d * q.float() + m).reshape(shape)
    return torch.from_numpy(dequantize(raw.numpy().reshape(shape[0], -1), qtype)).reshape(shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (per head: pairs interleaved) -> HF rotate-half order. w: [H*D, ...]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(header: GGUFHeader, buf: mmap.mmap) -> ModelConfig:
    meta, tensors = header.metadata, header.tensors

    def get(key: str, default: Any = None) -> Any:
        if key not in meta:
            if default is None:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return default
        return meta[key]

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF general.architecture={arch!r}; accepted: 'llama', 'qwen2'")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(get(f"{arch}.embedding_length"))
    heads = int(get(f"{arch}.attention.head_count"))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // heads))
    theta = float(get(f"{arch}.rope.freq_base", 10000.0))
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(header, buf, arch, head_dim, theta),
        max_position_embeddings=int(get(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _rope_scaling(
    header: GGUFHeader, buf: mmap.mmap, arch: str, head_dim: int, theta: float
) -> RopeScaling | None:
    if header.metadata.get(f"{arch}.rope.scaling.type") == "linear":
        return RopeScaling("linear", float(header.metadata[f"{arch}.rope.scaling.factor"]))
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is None:
        return None
    scaling = _LLAMA3_DEFAULTS
    expected = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)  # [D/2]
    got = _thunk(buf, freqs, 0)(None).float()
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-3):
        raise ValueError(
            "GGUF rope_freqs.weight is not the Llama 3.1 scaling (factor 8, low 1, high 4, 8192)"
        )
    return scaling
