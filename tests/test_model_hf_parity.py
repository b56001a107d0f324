"""Our LlamaModel over a paged KV cache vs Hugging Face's own model classes (tiny seeded checkpoints).

Each family is built as HF's class, saved with save_pretrained (safetensors), loaded with load_model,
and run through ReferenceOps: a full prefill, a 25-token prefill then per-token decode, and a varlen
batch of two sequences (prefill, then one batched decode step) must all give HF's logits within 1e-4.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pdserve.shared.model.loader import LoadedModel, load_model
from pdserve.tests.harness.paged_runner import PagedRunner
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}
TOL = 1e-4
PROMPT_LEN = 40
PREFILL_LEN = 25
COMMON: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)


def _hf_model(family: str) -> Any:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed({"llama3": 1, "qwen2": 2, "mistral": 3}[family])
    if family == "llama3":
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=32)  # fmt: skip
        model: Any = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, rope_parameters=QWEN_ROPE))
    else:
        model = MistralForCausalLM(MistralConfig(**COMMON, head_dim=16, sliding_window=4096))
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.float().eval()


def _save_tiny_tokenizer(path: str) -> None:
    vocab = {f"w{i}": i for i in range(COMMON["vocab_size"])}
    tok = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


@dataclass
class Case:
    family: str
    loaded: LoadedModel
    prompt: torch.Tensor  # [PROMPT_LEN] int64
    other: torch.Tensor  # [23] int64, a second sequence for batching
    ref: torch.Tensor  # [PROMPT_LEN, V] HF logits
    ref_other: torch.Tensor  # [23, V]


@pytest.fixture(scope="module", params=["llama3", "qwen2", "mistral"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.set_num_threads(1)
    family = request.param
    hf = _hf_model(family)
    path = str(tmp_path_factory.mktemp(family))
    # mistral is saved sharded, to read the index path too
    hf.save_pretrained(path, max_shard_size="100KB" if family == "mistral" else "1GB")
    _save_tiny_tokenizer(path)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, COMMON["vocab_size"], (PROMPT_LEN,), generator=gen)
    other = torch.randint(3, COMMON["vocab_size"], (23,), generator=gen)
    with torch.inference_mode():
        ref = hf(prompt[None]).logits[0].float()
        ref_other = hf(other[None]).logits[0].float()
    loaded = load_model(path, device=torch.device("cpu"), dtype=torch.float32)
    return Case(family, loaded, prompt, other, ref, ref_other)


def test_full_prefill_matches_hf(case: Case) -> None:
    runner = PagedRunner(case.loaded.model)
    logits = runner.step({runner.add_sequence(): case.prompt})
    assert logits.dtype == torch.float32 and logits.shape == case.ref.shape
    print(f"\n{case.family}: max |dlogit| vs HF {(logits - case.ref).abs().max().item():.2e}")
    assert (logits - case.ref).abs().max().item() <= TOL, case.family
    assert runner.hooked == list(range(case.loaded.config.num_layers))


def test_prefill_then_decode_matches_hf(case: Case) -> None:
    runner = PagedRunner(case.loaded.model)
    seq = runner.add_sequence()
    rows = [runner.step({seq: case.prompt[:PREFILL_LEN]})]
    for i in range(PREFILL_LEN, PROMPT_LEN):
        rows.append(runner.step({seq: case.prompt[i : i + 1]}))
    logits = torch.cat(rows)
    assert (logits - case.ref).abs().max().item() <= TOL, case.family


def test_varlen_batch_prefill_and_batched_decode(case: Case) -> None:
    runner = PagedRunner(case.loaded.model)
    a, b = runner.add_sequence(), runner.add_sequence()
    n_b = len(case.other) - 1
    logits = runner.step({a: case.prompt[:-1], b: case.other[:-1]})
    assert (logits[: PROMPT_LEN - 1] - case.ref[:-1]).abs().max().item() <= TOL
    assert (logits[PROMPT_LEN - 1 :] - case.ref_other[:n_b]).abs().max().item() <= TOL
    last = runner.step({a: case.prompt[-1:], b: case.other[-1:]})  # one decode step, both sequences
    assert (last[0] - case.ref[-1]).abs().max().item() <= TOL
    assert (last[1] - case.ref_other[-1]).abs().max().item() <= TOL


def test_config_read_from_checkpoint(case: Case) -> None:
    cfg = case.loaded.config
    assert cfg.architecture == {"llama3": "llama", "qwen2": "qwen2", "mistral": "mistral"}[case.family]
    assert cfg.attention_bias == (case.family == "qwen2")
    assert cfg.tie_word_embeddings == (case.family == "qwen2")
    assert (cfg.rope_scaling is not None) == (case.family == "llama3")
    assert cfg.eos_token_ids == (2,)
    assert len(case.loaded.weights_identity) == 32
