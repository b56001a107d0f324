"""Our LlamaModel over a paged KV cache vs Hugging Face's own model classes (tiny seeded checkpoints).

Each family (the dense Llama 3, Qwen2 and Mistral built here; Qwen3 and the mixture-of-experts families
of tests/harness/tiny_models.py) is built as HF's class, saved with save_pretrained (safetensors), loaded
with load_model, and run through ReferenceOps: a full prefill, a 25-token prefill then per-token decode,
and a varlen batch of two sequences (prefill, then one batched decode step) must all give HF's logits
within 1e-4. Also: what each family's config reads from config.json.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from pdserve.shared.model.model_config import ModelConfig
from pdserve.tests.harness.cluster_fixture import model_path
from pdserve.tests.harness.parity_case import (
    ParityCase,
    check_full_prefill,
    check_prefill_then_decode,
    check_varlen_batch,
    parity_case,
)
from pdserve.tests.harness.tiny_models import FAMILIES, TINY, VOCAB, hf_tiny_model, redraw
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

DENSE = ("llama3", "qwen2", "mistral")
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}
COMMON: dict[str, Any] = TINY | {"vocab_size": 300, "max_position_embeddings": 256}


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
        model = Qwen2ForCausalLM(
            Qwen2Config(**{**COMMON, "tie_word_embeddings": True}, rope_parameters=QWEN_ROPE)
        )
    else:
        model = MistralForCausalLM(MistralConfig(**COMMON, head_dim=16, sliding_window=4096))
    return redraw(model)


def _save_tiny_tokenizer(path: str) -> None:
    vocab = {f"w{i}": i for i in range(COMMON["vocab_size"])}
    tok = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


@pytest.fixture(scope="module", params=DENSE + FAMILIES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParityCase:
    family = request.param
    path = str(tmp_path_factory.mktemp(family))
    if family in DENSE:
        hf = _hf_model(family)
        # mistral is saved sharded, to read the index path too
        hf.save_pretrained(path, max_shard_size="100KB" if family == "mistral" else "1GB")
        _save_tiny_tokenizer(path)
        return parity_case(family, hf, path, COMMON["vocab_size"])
    hf = hf_tiny_model(family)
    # mixtral is saved sharded, to read the index path too
    hf.save_pretrained(path, max_shard_size="1MB" if family == "mixtral" else "1GB")
    return parity_case(family, hf, path, VOCAB, tokenizer_path=model_path())


def test_full_prefill_matches_hf(case: ParityCase) -> None:
    runner = check_full_prefill(case)
    assert runner.hooked == list(range(case.loaded.config.num_layers))


def test_prefill_then_decode_matches_hf(case: ParityCase) -> None:
    check_prefill_then_decode(case)


def test_varlen_batch_prefill_and_batched_decode(case: ParityCase) -> None:
    check_varlen_batch(case)


@pytest.mark.parametrize("case", DENSE, indirect=True)
def test_dense_config_read_from_checkpoint(case: ParityCase) -> None:
    cfg = case.loaded.config
    assert cfg.architecture == {"llama3": "llama", "qwen2": "qwen2", "mistral": "mistral"}[case.family]
    assert cfg.attention_bias == (case.family == "qwen2")
    assert cfg.tie_word_embeddings == (case.family == "qwen2")
    assert (cfg.rope_scaling is not None) == (case.family == "llama3")
    assert cfg.eos_token_ids == (2,)
    assert len(case.loaded.weights_identity) == 32


@pytest.mark.parametrize("case", FAMILIES, indirect=True)
def test_qwen3_and_moe_config_read_from_checkpoint(case: ParityCase) -> None:
    cfg = case.loaded.config
    assert cfg.architecture == case.family
    assert cfg.qk_norm == case.family.startswith("qwen3")
    assert cfg.head_dim == (32 if case.family.startswith("qwen3") else 16)
    assert cfg.attention_bias == (case.family == "qwen2_moe") and not cfg.o_bias
    if case.family == "qwen3":
        assert cfg.moe is None
        return
    moe = cfg.moe
    assert moe is not None
    expected = {
        "qwen3_moe": (8, 2, 32, True, 0, (1,)),
        "mixtral": (4, 2, 96, True, 0, ()),
        "qwen2_moe": (4, 2, 32, False, 48, ()),
    }[case.family]
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob,
            moe.shared_expert_intermediate_size, moe.mlp_only_layers) == expected  # fmt: skip
    sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_layers)]
    assert sparse == ([True, False, True] if case.family == "qwen3_moe" else [True, True])
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
