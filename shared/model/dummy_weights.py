"""Seeded random weights for any `ModelConfig`, for benchmarks and tests without a checkpoint.

Invariants: the same (config, seed, device type) gives bit-identical weights, whatever the tensor-parallel
size: each Hugging Face-named tensor is drawn whole from its own generator, seeded from (seed, name), and
each rank keeps its slice (one whole tensor at a time exists beside the model), so TP=1 and TP=N hold the
same model. Norms are 1, the two projections that write into the residual stream (attention output, MLP
down, each expert's down) are N(0, 0.02 / sqrt(2 L)) as in GPT-2's and Megatron's initialisation, every
other tensor is N(0, 0.02). The scaled outputs keep the residual stream from growing layer over layer,
so a random 32-layer model is not chaotic: two correct kernels that round differently give nearly the
same logits, as they do on trained weights. Weights are drawn on the model's own device (fast for an 8B
shape on a GPU), and a CUDA generator draws different numbers than a CPU one, so the identity covers the
device type.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import ModelConfig
from pdserve.shared.model.moe import moe_hf_shapes
from pdserve.shared.model.parallel import RowSlice, narrow

INIT_STD = 0.02
RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", ".w2.weight")  # Mixtral's expert down is w2


def dummy_weights_identity(config: ModelConfig, seed: int, device: torch.device) -> bytes:
    """SHA-256 over the seed, the device type and the canonical config: the weights' identity."""
    blob = json.dumps({"seed": seed, "device_type": device.type, "config": config.to_dict()}, sort_keys=True)
    return hashlib.sha256(b"pdserve-dummy-weights-v3\0" + blob.encode()).digest()


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face-named tensor of `config`'s checkpoint and its shape."""
    c = config
    e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, e),
        "model.norm.weight": (e,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, e)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        rows = {"q_proj": c.num_heads * d, "k_proj": c.num_kv_heads * d, "v_proj": c.num_kv_heads * d}
        for proj, n in rows.items():
            shapes[f"{p}self_attn.{proj}.weight"] = (n, e)
            if c.attention_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (n,)
        shapes[p + "self_attn.o_proj.weight"] = (e, c.num_heads * d)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (e,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "input_layernorm.weight"] = (e,)
        shapes[p + "post_attention_layernorm.weight"] = (e,)
        if c.is_sparse_layer(i):
            shapes.update(moe_hf_shapes(c, i))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (f, e)
        shapes[p + "mlp.up_proj.weight"] = (f, e)
        shapes[p + "mlp.down_proj.weight"] = (e, f)
    return shapes


class DummyWeights:
    """A `WeightSource` of seeded random tensors, drawn on `device` in `dtype` when read."""

    def __init__(self, config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.shapes = hf_shapes(config)
        self.seed, self.device, self.dtype = seed, device, dtype
        self.residual_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def names(self) -> frozenset[str]:
        return frozenset(self.shapes)

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return narrow(torch.ones(shape, device=self.device, dtype=self.dtype), part)
        digest = hashlib.sha256(f"{self.seed}\0{name}".encode()).digest()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        std = self.residual_std if name.endswith(RESIDUAL_WRITERS) else INIT_STD
        whole = torch.empty(shape, device=self.device, dtype=self.dtype).normal_(0.0, std, generator=gen)
        return narrow(whole, part)


def fill_dummy_weights(model: LlamaModel, seed: int) -> None:
    """Fill `model` (its rank's share) in place with the seeded weights of its config."""
    model.load_weights(DummyWeights(model.config, seed, model.embed_weight.device, model.dtype))
