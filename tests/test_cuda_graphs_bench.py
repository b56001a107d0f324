"""benchmarks/gpu_decode.py's CPU-side logic: the roofline's byte counts, the steady-state window, the
logit comparison, and teacher forcing / greedy decoding through real runners (torch reference ops, and
the decode-graph static path run eagerly), on a 2-layer SmolLM2-shaped model."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs
from pdserve.shared.engine.model_runner import ModelRunner
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.model.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"


def tiny_loaded() -> LoadedModel:
    cfg = dataclasses.replace(NAMED_SHAPES["smollm2-135m"], num_layers=2, vocab_size=512)
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    fill_dummy_weights(model, seed=1)
    tok = Tokenizer.byte_level(cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    return LoadedModel(cfg, model.eval(), tok, b"tiny", "dummy:tiny")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_decode", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_decode"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_and_no_gpu_exit() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--check-shape" in done.stdout and "--out" in done.stdout
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "needs a CUDA device" in done.stdout


def test_roofline_bytes(bench: ModuleType) -> None:
    c = NAMED_SHAPES["llama-3.1-8b"]
    # 8B: 32 layers x (4096*6144 qkv + 4096*4096 o + 2*4096*14336 gate/up + 14336*4096 down + 2*4096 norms)
    # + final norm + lm_head (the embedding table is not read); bf16
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    want = 2 * (32 * per_layer + 4096 + 128256 * 4096)
    meta = torch.device("meta")
    model = LlamaModel(c, meta, torch.bfloat16)
    assert bench.weight_bytes_read(model, tied=False) == want
    assert bench.kv_bytes_per_token(c, torch.bfloat16) == 32 * 2 * 8 * 128 * 2
    tied = LlamaModel(NAMED_SHAPES["smollm2-135m"], meta, torch.float32)
    assert bench.weight_bytes_read(tied, tied=True) == 4 * sum(p.numel() for p in tied.parameters())


def test_steady_rate_window(bench: ModuleType) -> None:
    Step = bench.Step
    # batch 2: step 0 prefills one request, steps 1.. decode both, step 6 finishes both
    steps = [Step(0.0, 1, 1)] + [Step(float(i), 2, 2) for i in range(1, 6)] + [Step(6.0, 2, 0)]
    rate, timed = bench.steady_rate(steps, 2, skip=1)
    assert timed == 3 and rate == pytest.approx(6 / 3)  # from step 2 to step 5: 3 steps, 6 tokens
    with pytest.raises(ValueError, match="only 5 steps decoded all 2"):
        bench.steady_rate(steps, 2, skip=4)


def test_compare_logits(bench: ModuleType) -> None:
    a = torch.randn(5, 11)
    b = a.clone()
    b[2] = -b[2]
    r = bench.compare_logits(a, b)
    assert r["top1_agreement"] == pytest.approx(0.8) and r["min_cosine"] == pytest.approx(-1.0)
    same = bench.compare_logits(a, a)
    assert same["max_abs_diff"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["min_cosine"] == pytest.approx(1.0, abs=1e-12)
    table = bench.markdown([("m", "v", "p", bench.verdict(True))])
    assert table.splitlines()[2] == "| m | v | p | ok |"


def test_teacher_forcing_and_greedy_through_runners(bench: ModuleType) -> None:
    """The benchmark's correctness path on CPU: an eager runner vs one whose decode steps take the
    decode-graph static path (padding-free bucket 1, fixed max_seq_len)."""
    torch.set_num_threads(1)
    loaded = tiny_loaded()
    cfg = EngineConfig(model="dummy:tiny", max_num_seqs=1, max_model_len=256)
    ref = ModelRunner(loaded, cfg, 32)
    fast = ModelRunner(loaded, cfg, 32)
    fast.graphs = DecodeGraphs(fast.model, fast.kv_cache, fast.ops, block_size=16, max_num_seqs=1,
                               max_model_len=256, capture=False)  # fmt: skip
    rng = random.Random(0)
    tokens = [rng.randrange(loaded.config.vocab_size) for _ in range(40)]
    got = bench.teacher_forced_logits(fast, tokens, 24)
    want = bench.teacher_forced_logits(ref, tokens, 24)
    assert got.shape == (17, loaded.config.vocab_size)
    r = bench.compare_logits(got, want)
    assert r["max_abs_diff"] < 1e-4 and r["top1_agreement"] == 1.0
    # teacher-forced row k predicts token 24 + k: greedy from the same prompt starts with row 0's argmax
    greedy = bench.greedy_by_runner(fast, tokens[:24], 6)
    assert greedy[0] == int(want[0].argmax())
    assert greedy == bench.greedy_by_runner(ref, tokens[:24], 6)


def test_noise_floor_twin_is_the_same_function(bench: ModuleType) -> None:
    """permute_hidden gives an exactly equivalent model (fp32 logits agree to rounding) and argsort undoes it
    bit for bit; noise_floor leaves the weights as it found them."""
    torch.set_num_threads(1)
    loaded = tiny_loaded()
    before = {n: p.clone() for n, p in loaded.model.named_parameters()}
    cfg = EngineConfig(model="dummy:tiny", max_num_seqs=1, max_model_len=256)
    rng = random.Random(1)
    tokens = [rng.randrange(loaded.config.vocab_size) for _ in range(72)]
    want = bench.teacher_forced_logits(ModelRunner(loaded, cfg, 32), tokens, 64)
    floor = bench.noise_floor(loaded, cfg, tokens, want)
    assert floor["max_abs_diff"] < 1e-4 and floor["top1_agreement"] == 1.0, floor
    assert all(torch.equal(p, before[n]) for n, p in loaded.model.named_parameters())
    perm = torch.randperm(loaded.config.hidden_size)
    bench.permute_hidden(loaded.model, perm)
    assert not torch.equal(loaded.model.embed_weight, before["embed_weight"])
    assert torch.equal(loaded.model.embed_weight, before["embed_weight"][:, perm])


def test_within_floor(bench: ModuleType) -> None:
    floor = {"top1_agreement": 0.9, "min_cosine": 0.998}
    assert bench.within_floor({"top1_agreement": 0.8, "min_cosine": 0.996}, floor)
    assert not bench.within_floor({"top1_agreement": 0.79, "min_cosine": 0.999}, floor)
    assert not bench.within_floor({"top1_agreement": 1.0, "min_cosine": 0.9959}, floor)
