"""Tiny seeded checkpoints of the Qwen3 and mixture-of-experts families, built with Hugging Face's own
classes and saved with `save_pretrained` (safetensors, fp32), with SmolLM2's tokenizer beside them (their
vocabulary is SmolLM2's 49,152 tokens), so `pdserve generate`, a node and the router serve them as they
are. HF initialises norms to 1 and the Qwen-MoE router to 0 (every expert tied): both are redrawn, so the
q/k norms matter and each token's top-k is clear.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

VOCAB = 49152
FAMILIES = ("qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
"""The keyword arguments of every tiny HF config here (Llama-family names); tests override a few."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def hf_tiny_model(family: str, seed: int = 0) -> Any:
    """The seeded fp32 HF model of `family` (one of FAMILIES), in eval mode.

    qwen3: head_dim 32 with hidden 64 (head_dim independent of the hidden size); qwen3_moe: 8 experts, top
    2 renormalised, 3 layers of which the middle one is dense (`mlp_only_layers`); mixtral: 4 experts, top
    2; qwen2_moe: 4 experts, top 2 not renormalised, a shared expert with its sigmoid gate, q/k/v biases."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if family == "qwen3":
        model: Any = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32))
    elif family == "qwen3_moe":
        moe: dict[str, Any] = dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, **moe))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))
    elif family == "qwen2_moe":
        shared: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, norm_topk_prob=False)  # fmt: skip
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY, **shared))
    else:
        raise ValueError(f"family {family!r}; accepted: {FAMILIES}")
    return redraw(model)


def redraw(model: Any) -> Any:
    """HF initialises norms to 1, biases to 0 and the Qwen-MoE router to 0: redrawn so that they matter;
    returns `model` in fp32, in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
            ):
                p.normal_(0.0, 0.5)
    return model.float().eval()


def save_tiny_checkpoint(family: str, path: str, tokenizer_dir: str, seed: int = 0) -> Any:
    """Saves `family`'s tiny model to `path` with the tokenizer files of `tokenizer_dir` (an HF directory of
    SmolLM2's tokenizer: conftest's `hf_smollm2().saved_dir`); returns the HF model."""
    model = hf_tiny_model(family, seed)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """Hugging Face's greedy continuation of `prompt` (full forward each step, EOS ignored)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
