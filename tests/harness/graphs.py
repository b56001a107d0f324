"""The engine's graph tests' parts: a 2-layer SmolLM2-shaped model with dummy weights (tiny_loaded), a CPU
runner of it shared by a test module (the cpu_runner fixture: import it and name it in __all__), and the
checks a captured graph's step must pass (replay_matches_eager, on_gpu_frees_memory)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.shared.engine.prefill_graphs import PrefillGraphs
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.model.tokenizer import Tokenizer

BLOCK = 16
MAX_LEN = 128  # 8 blocks per sequence
NUM_BLOCKS = 96
MAX_SEQS = 6  # buckets 1, 2, 4, 6


_Graphs = TypeVar("_Graphs", DecodeGraphs, PrefillGraphs)


def uncaptured(cls: type[_Graphs], runner: ModelRunner, buckets: tuple[int, ...]) -> _Graphs:
    """`cls` over `runner`'s model, cache and ops with the harness's block size and length, not captured
    (its buffers and bucketing run eagerly, so a CPU test checks them)."""
    return cls(runner.model, runner.kv_cache, runner.ops, block_size=BLOCK, max_model_len=MAX_LEN,
               buckets=buckets, capture=False)  # fmt: skip


def on_gpu(test: Callable[..., None]) -> Callable[..., None]:
    """Marks a test `gpu` and skips it where CUDA is not available."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def tiny_loaded(device: torch.device, dtype: torch.dtype = torch.float32) -> LoadedModel:
    cfg = dataclasses.replace(NAMED_SHAPES["smollm2-135m"], num_layers=2, vocab_size=512)
    model = LlamaModel(cfg, device, dtype)
    fill_dummy_weights(model, seed=1)
    tok = Tokenizer.byte_level(cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    return LoadedModel(cfg, model.eval(), tok, b"tiny", "dummy:tiny")


@pytest.fixture(scope="module")
def cpu_runner() -> ModelRunner:
    torch.set_num_threads(1)
    cfg = EngineConfig(model="dummy:tiny", max_num_seqs=MAX_SEQS, cuda_graphs=True, max_model_len=MAX_LEN)
    runner = ModelRunner(tiny_loaded(torch.device("cpu")), cfg, NUM_BLOCKS, max_model_len=MAX_LEN)
    assert runner.graphs is None  # CPU never captures
    return runner


def replay_matches_eager(
    runner: ModelRunner, items: list[BatchItem], written: torch.Tensor, tol: float
) -> None:
    """One step through the runner's graphs, then the same step from the same KV with every graph kind set
    aside (the eager path): the same logits and KV, and nothing written outside `written` [blocks, B]."""
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    got = runner.execute(items)
    kv_graph = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    kinds = runner.graphs, runner.prefill_graphs
    runner.graphs = runner.prefill_graphs = None
    want = runner.execute(items)
    runner.graphs, runner.prefill_graphs = kinds
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(kv_graph, runner.kv_cache, rtol=tol, atol=tol)
    written = written.to(runner.kv_cache.device)
    assert torch.equal(kv_graph[:, :, ~written], before[:, :, ~written])


def on_gpu_frees_memory(
    cfg: EngineConfig, dtype: torch.dtype, exercise: Callable[[ModelRunner], None]
) -> None:
    """Builds a GPU runner (graphs captured) of the tiny model, runs `exercise` on it, closes it: the device
    memory comes back to within 1 MiB of where it started."""
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(dev)
    runner = ModelRunner(tiny_loaded(dev, dtype), cfg, NUM_BLOCKS, max_model_len=MAX_LEN)
    exercise(runner)
    runner.close()
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(dev) - start < 1 << 20
