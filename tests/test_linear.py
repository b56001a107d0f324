"""The model's matrix-product backends: the packed oneDNN product equals F.linear, and is what a CPU fp32
model uses once its weights are loaded."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from pdserve.kernels.linear import DenseLinear, GemvLinear, OneDnnPackedLinear, select_linear
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_equals_dense(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 96, generator=gen)
    b = torch.randn(192, generator=gen) if with_bias else None
    x = torch.randn(rows, 96, generator=gen)
    packed = OneDnnPackedLinear()
    got = packed.linear(x, packed.prepare(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_handle_is_a_snapshot_and_shapes_are_checked() -> None:
    w = torch.ones(8, 4)
    packed = OneDnnPackedLinear()
    handle = packed.prepare(w)
    w.zero_()
    assert torch.equal(packed.linear(torch.ones(2, 4), handle, None), torch.full((2, 8), 4.0))
    with pytest.raises(AssertionError, match=r"x must be \[T, 4\]"):
        packed.linear(torch.ones(2, 5), handle, None)
    with pytest.raises(AssertionError, match="2-D fp32 on the CPU"):
        packed.prepare(torch.ones(8, 4, dtype=torch.bfloat16))


def test_selection_by_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_linear(cpu, torch.bfloat16), DenseLinear)
    if importlib.util.find_spec("triton") is not None:  # the [gpu] extra; a CPU install may lack it
        assert isinstance(select_linear(torch.device("cuda"), torch.bfloat16), GemvLinear)
    want = OneDnnPackedLinear if torch.backends.mkldnn.is_available() else DenseLinear
    assert isinstance(select_linear(cpu, torch.float32), want)


def test_loaded_model_uses_the_device_product_and_keeps_its_logits() -> None:
    cfg = dataclasses.replace(NAMED_SHAPES["smollm2-135m"], num_layers=2, vocab_size=256)
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    assert isinstance(model.linear, DenseLinear)  # before any weights
    fill_dummy_weights(model, seed=3)
    assert model.linear.name == select_linear(torch.device("cpu"), torch.float32).name
    hidden = torch.randn(5, cfg.hidden_size)
    got = model.compute_logits(hidden)
    normed = model.norm(hidden)
    torch.testing.assert_close(got, F.linear(normed, model.lm_head_weight), rtol=1e-5, atol=1e-5)
    assert "layers.0.qkv_w" not in model.state_dict()  # handles are not parameters
