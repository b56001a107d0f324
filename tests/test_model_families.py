"""Qwen3 and the mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE) beyond their logit parity with
Hugging Face (test_model_hf_parity.py holds that and what their configs read): the named dummy shapes, the
one-line errors of a bad checkpoint or MoE config (tiny seeded checkpoints of tests/harness/tiny_models.py),
and each tensor-parallel rank's slice of the experts.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch
from pdserve.shared.model.dummy_weights import fill_dummy_weights, hf_shapes
from pdserve.shared.model.loader import ModelLoadError, load_model
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES, ModelConfig
from pdserve.shared.model.parallel import SingleRank, check_split, plan
from pdserve.tests.harness.cluster_fixture import model_path
from pdserve.tests.harness.tiny_models import hf_tiny_model


def test_dense_config_dict_is_unchanged_by_moe() -> None:
    """The fingerprint hashes to_dict(): a dense model's must not gain a key."""
    assert "moe" not in NAMED_SHAPES["llama-3.1-8b"].to_dict()
    assert NAMED_SHAPES["qwen3-30b-a3b"].to_dict()["moe"]["num_experts"] == 128


@pytest.mark.parametrize(
    ("shape", "params_b", "active_b"),
    [
        ("qwen3-8b", 8.19, 8.19),
        ("qwen3-32b", 32.8, 32.8),
        ("qwen3-30b-a3b", 30.5, 3.35),
        ("mixtral-8x7b", 46.7, 12.9),
    ],
)
def test_named_shapes_have_the_published_sizes(shape: str, params_b: float, active_b: float) -> None:
    """Parameter counts from the shapes' tensors (published: Qwen3-8B 8.2B, Qwen3-32B 32.8B, Qwen3-30B-A3B
    30.5B with 3.3B active, Mixtral-8x7B 46.7B with 12.9B active)."""
    cfg = NAMED_SHAPES[shape]
    shapes = hf_shapes(cfg)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    moe = cfg.moe
    idle = 0 if moe is None else sum(
        torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n
    ) * (moe.num_experts - moe.top_k) // moe.num_experts  # fmt: skip
    assert abs(total / 1e9 - params_b) / params_b < 0.02, total
    assert abs((total - idle) / 1e9 - active_b) / active_b < 0.03, total - idle


def _break(path: str, edit: Any) -> None:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    ("family", "edit", "expected"),
    [
        ("qwen3", lambda c: c.update(model_type="gpt_oss"), "model_type='gpt_oss'; accepted: ("),
        ("qwen3_moe", lambda c: c.pop("num_local_experts"), "has no num_experts"),
        (
            "qwen3",
            lambda c: c.update(head_dim=16),
            "self_attn.q_proj.weight' has shape (128, 64), expected (64, 64)",
        ),
    ],
    ids=["unknown-architecture", "moe-without-experts", "wrong-head-dim"],
)
def test_bad_config_is_one_load_error(family: str, edit: Any, expected: str, tmp_path: Any) -> None:
    hf_tiny_model(family).save_pretrained(tmp_path)
    _break(str(tmp_path), edit)
    with pytest.raises(ModelLoadError) as info:
        load_model(
            str(tmp_path), device=torch.device("cpu"), dtype=torch.float32, tokenizer_path=model_path()
        )
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


class _RankOne(SingleRank):
    rank, size = 1, 2


def _tiny_moe() -> ModelConfig:
    """A 1-layer Qwen2-MoE-like shape: 4 experts of width 32, a shared expert of width 48."""
    base = NAMED_SHAPES["qwen3-30b-a3b"].to_dict()
    return ModelConfig.from_dict(
        base
        | {
            "architecture": "qwen2_moe",
            "bos_token_id": 1,
            "eos_token_ids": [2],
            "vocab_size": 500,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_layers": 1,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "attention_bias": True,
            "moe": {
                "num_experts": 4,
                "top_k": 2,
                "intermediate_size": 32,
                "norm_topk_prob": False,
                "shared_expert_intermediate_size": 48,
            },
        }
    )


def test_each_rank_holds_its_slice_of_every_expert() -> None:
    cfg = _tiny_moe()
    cpu = torch.device("cpu")
    whole = LlamaModel(cfg, cpu, torch.float32)
    fill_dummy_weights(whole, seed=3)
    part = LlamaModel(cfg, cpu, torch.float32, plan(cfg, 1, 2), _RankOne())
    fill_dummy_weights(part, seed=3)
    w, s = whole.decoder_layers[0].moe, part.decoder_layers[0].moe
    assert w is not None and s is not None
    assert torch.equal(s.router_weight, w.router_weight)  # replicated
    for j in range(4):  # gate rows 16..31 and up rows 16..31 of each expert; its down columns 16..31
        assert torch.equal(s.gate_up_weight[j, :16], w.gate_up_weight[j, 16:32])
        assert torch.equal(s.gate_up_weight[j, 16:], w.gate_up_weight[j, 48:])
        assert torch.equal(s.down_weight[j], w.down_weight[j, :, 16:])
    assert s.shared_gate_up_weight is not None and w.shared_gate_up_weight is not None
    assert torch.equal(s.shared_gate_up_weight[:24], w.shared_gate_up_weight[24:48])
    assert s.shared_gate_weight is not None and w.shared_gate_weight is not None
    assert torch.equal(s.shared_gate_weight, w.shared_gate_weight)


def test_split_that_cuts_an_expert_is_refused() -> None:
    cfg = _tiny_moe()
    check_split(cfg, 2)
    odd = ModelConfig.from_dict(cfg.to_dict() | {"moe": cfg.to_dict()["moe"] | {"intermediate_size": 30}})
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's expert"):
        check_split(odd, 4)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"architecture": "llama"}, "need a MoEConfig and the others take none"),
        (
            {"moe": {"num_experts": 4, "top_k": 5, "intermediate_size": 8, "norm_topk_prob": True}},
            "moe.top_k=5 exceeds num_experts=4",
        ),
        (
            {"moe": {"num_experts": 0, "top_k": 1, "intermediate_size": 8, "norm_topk_prob": True}},
            "moe.num_experts=0 must be a positive int",
        ),
    ],
)
def test_bad_moe_config_names_the_field(change: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        ModelConfig.from_dict(_tiny_moe().to_dict() | change)
