"""The Hugging Face reference of the SmolLM2 GGUF: transformers' own load of the file and its tokenizer, and
an HF safetensors directory saved from that load. conftest.py's `hf_smollm2` makes it once per session for
the modules that compare against it (the load takes about 20 s on the 2-core VM, most of it reading the
GGUF's metadata).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from pdserve.shared.cli.default_model import default_model_path
from safetensors.torch import save_file


@dataclass(frozen=True)
class HFSmolLM2:
    model: Any
    """transformers' model, fp32, eval mode"""
    tokenizer: Any
    saved_dir: str
    """config, weights (safetensors) and tokenizer of `model`, as an HF directory"""


def load_hf_smollm2(saved_dir: str) -> HFSmolLM2:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers refuses save_pretrained on a GGUF-loaded model: save its config and weights directly
    model.config.save_pretrained(saved_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, os.path.join(saved_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(saved_dir)
    return HFSmolLM2(model, tokenizer, saved_dir)
