"""FP8 weights on the CPU (shared/model/fp8.py): a tiny FP8 checkpoint written with safetensors, as
Llama-FP8 (per-tensor `weight_scale`, static `input_scale`) and DeepSeek/Qwen3-FP8 (128 x 128
`weight_scale_inv`) ship it, read through the HF reader; its weights dequantize to the reference, a model
on them gives the unquantized model's logits within FP8's error, and the loader refuses FP8 on the CPU.

The reference weights are dequantized here, independently of the module: FP8 values times the scale of
their tensor or block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.shared.model.dummy_weights import hf_shapes
from pdserve.shared.model.fp8 import QUANTIZED_SUFFIXES, SCALE, Fp8Weights, checkpoint_quantization
from pdserve.shared.model.hf_loader import read_hf_dir
from pdserve.shared.model.loader import LoadedModel, ModelLoadError, load_model
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import ModelConfig
from pdserve.shared.model.parallel import RowSlice, narrow
from pdserve.shared.model.tokenizer import Tokenizer
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
HF_CONFIG = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 256, "intermediate_size": 320,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
"""Intermediate size 320 = 2.5 blocks of 128: the block-scaled checkpoint has partial blocks."""


class _Tensors:
    """A WeightSource over tensors in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> frozenset[str]:
        return frozenset(self.tensors)

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        return narrow(self.tensors[name], part)


class _Thunks(_Tensors):
    """A WeightSource over the HF reader's thunks (what the loader reads through)."""

    def __init__(self, path: Path) -> None:
        _, self.thunks, _ = read_hf_dir(str(path))
        super().__init__({})

    def names(self) -> frozenset[str]:
        return frozenset(self.thunks)

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        return self.thunks[name](part)


def _block_scales(w: torch.Tensor) -> torch.Tensor:
    """[ceil(N/128), ceil(K/128)]: each block's max |w| / 448."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = w.abs()
    return padded.view(padded.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3)) / 448.0


def _expand(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _write_checkpoint(path: Path, scheme: str) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint in `path` (scheme "tensor" or "block"); returns its weights dequantized, fp32."""
    gen = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes(ModelConfig.from_hf_config(HF_CONFIG)).items():
        if name.endswith("norm.weight"):
            w = 0.5 + torch.rand(shape, generator=gen)
        else:
            w = torch.randn(shape, generator=gen) * 0.05
        if not name.endswith(QUANTIZED_SUFFIXES):
            tensors[name] = w.bfloat16()
            reference[name] = w.bfloat16().float()
            continue
        if scheme == "tensor":
            s = w.abs().max() / 448.0  # a 0-d scale, as Llama FP8 checkpoints store it
            q = (w / s).to(FP8)
            tensors[name], tensors[name + "_scale"] = q, s
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)  # static: ignored
            reference[name] = q.float() * s
        else:
            s = _block_scales(w)
            q = (w / _expand(s, *shape)).to(FP8)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            reference[name] = q.float() * _expand(s, *shape)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    quant: dict[str, object] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic" if scheme == "block" else "static",
    }
    if scheme == "block":
        quant["weight_block_size"] = [128, 128]
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, "quantization_config": quant}))
    return reference


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_an_fp8_checkpoint_reads_as_its_dequantized_weights(tmp_path: Path, scheme: str) -> None:
    reference = _write_checkpoint(tmp_path, scheme)
    assert checkpoint_quantization(str(tmp_path)) == "fp8"
    source = Fp8Weights(_Thunks(tmp_path))
    quantized = {n for n in reference if n.endswith(QUANTIZED_SUFFIXES)}
    assert len(quantized) == 14
    assert source.names() == frozenset(reference) | {n + SCALE for n in quantized}  # no checkpoint scales
    for name in sorted(quantized):
        q, scale = source.read(name, None), source.read(name + SCALE, None)
        assert q.dtype == FP8 and scale.shape == (q.shape[0],) and scale.dtype == torch.float32
        got, want = q.float() * scale[:, None], reference[name]
        if scheme == "tensor":  # used as stored: exactly the checkpoint's weights
            assert torch.equal(got, want), name
        else:  # requantized per row: one more FP8 rounding, half a step of e4m3's 3 mantissa bits
            bound = want.abs() * 2**-4 + scale[:, None] * 2**-9  # relative, or a subnormal's half step
            assert ((got - want).abs() <= bound * 1.0001).all(), name
    for name in sorted(set(reference) - quantized):
        assert torch.equal(source.read(name, None).float(), reference[name]), name


def test_a_rank_reads_its_rows_of_an_fp8_weight_and_their_scales(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, "block")
    name = "model.layers.1.mlp.gate_proj.weight"
    source = Fp8Weights(_Thunks(tmp_path))
    whole, scale = source.read(name, None), source.read(name + SCALE, None)
    rows = RowSlice(0, 160, 320)
    assert torch.equal(source.read(name, rows).view(torch.uint8), whole[160:].view(torch.uint8))
    assert torch.equal(source.read(name + SCALE, rows), scale[160:])
    cols = RowSlice(1, 0, 128)  # a row-parallel slice keeps every row, so every row's scale
    down = "model.layers.1.mlp.down_proj.weight"
    assert source.read(down, cols).shape == (256, 128) and source.read(down + SCALE, cols).shape == (256,)


def _last_logits(model: LlamaModel, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's last-token logits [len(prompts), V] through a CPU model runner."""
    cfg = model.config
    tok = Tokenizer.byte_level(cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    loaded = LoadedModel(cfg, model.eval(), tok, b"fp8-test", "dummy:fp8-test")
    runner = ModelRunner(loaded, EngineConfig(model="dummy:fp8-test", max_model_len=64), 16, max_model_len=64)
    items = [BatchItem(p, 0, len(p), [2 * i, 2 * i + 1], True) for i, p in enumerate(prompts)]
    return runner.execute(items)


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_a_model_on_fp8_weights_gives_the_dequantized_models_logits(tmp_path: Path, scheme: str) -> None:
    reference = _write_checkpoint(tmp_path, scheme)
    cfg = ModelConfig.from_hf_config(HF_CONFIG)
    fp8_model = LlamaModel(cfg, torch.device("cpu"), torch.float32, quantization="fp8")
    fp8_model.load_weights(_Thunks(tmp_path))
    assert fp8_model.decoder_layers[0].qkv_weight.dtype == FP8
    exact = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    exact.load_weights(_Tensors(reference))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    got, want = _last_logits(fp8_model, prompts), _last_logits(exact, prompts)
    # the weights are the same numbers; what differs is the activations' per-token FP8 rounding (measured:
    # cosine 0.997-0.999 on these random weights)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert (cosine > 0.99).all(), cosine
    assert torch.equal(got.argmax(1), want.argmax(1))


def test_the_loader_refuses_fp8_on_the_cpu(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, "tensor")
    with pytest.raises(ModelLoadError, match=r"with an FP8 checkpoint: FP8 weights need a GPU") as err:
        load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match=r"with --quantization fp8: FP8 weights need a GPU"):
        load_model("dummy:smollm2-135m", device=torch.device("cpu"), dtype=torch.float32, quantization="fp8")


def test_a_directory_saved_from_a_gguf_file_is_unquantized(tmp_path: Path) -> None:
    """transformers keeps `quantization_config: {quant_method: gguf}` in the config.json of a model it loaded
    from a GGUF file and saved: its tensors are the dequantized ones, not a method to refuse."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gguf"}}))
    assert checkpoint_quantization(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quant_method='awq'"):
        checkpoint_quantization(str(tmp_path))
