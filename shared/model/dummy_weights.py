"""Seeded random weights for any `ModelConfig`, for benchmarks and tests without a checkpoint.

Invariants: the same (config, seed, device type) gives bit-identical weights; norms are 1, the two
projections that write into the residual stream (attention output, MLP down) are N(0, 0.02 / sqrt(2 L)) as
in GPT-2's and Megatron's initialisation, every other tensor is N(0, 0.02). The scaled outputs keep the
residual stream from growing layer over layer, so a random 32-layer model is not chaotic: two correct
kernels that round differently give nearly the same logits, as they do on trained weights. Weights are
drawn on the model's own device (fast for an 8B shape on a GPU), and a CUDA generator draws different
numbers than a CPU one, so the identity covers the device type.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
from pdserve.shared.model.model import LlamaModel, RMSNorm
from pdserve.shared.model.model_config import ModelConfig

INIT_STD = 0.02


def dummy_weights_identity(config: ModelConfig, seed: int, device: torch.device) -> bytes:
    """SHA-256 over the seed, the device type and the canonical config: the weights' identity."""
    blob = json.dumps({"seed": seed, "device_type": device.type, "config": config.to_dict()}, sort_keys=True)
    return hashlib.sha256(b"pdserve-dummy-weights-v2\0" + blob.encode()).digest()


@torch.no_grad()
def fill_dummy_weights(model: LlamaModel, seed: int) -> None:
    """Fill every parameter of `model` in place, in registration order, from one seeded generator."""
    device = model.embed_weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    residual_std = INIT_STD / math.sqrt(2 * model.config.num_layers)
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif name.endswith((".o_weight", ".down_weight")):
            param.normal_(0.0, residual_std, generator=gen)
        else:
            param.normal_(0.0, INIT_STD, generator=gen)
    model.prepare_weights()
