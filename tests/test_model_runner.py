"""The eager step's attention metadata: block tables keep one width class whatever the batch; and CPU steps
reuse the memory that the last step freed.

Triton specializes a kernel on whether an int argument divides by 16; the tables' row stride is their width,
so a ragged width would compile a second attention kernel in the middle of serving. On the CPU with the torch
reference ops (a 2-layer SmolLM2-shaped model): every table the runner builds is a multiple of TABLE_ALIGN
wide, and a mixed batch (prefill chunks beside decodes) gives the logits its items give alone.
"""

from __future__ import annotations

import resource

import torch
from pdserve.kernels.ops import AttentionMetadata
from pdserve.kernels.reference import ReferenceOps
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import TABLE_ALIGN, BatchItem, ModelRunner
from pdserve.tests.harness.graphs import tiny_loaded

BLOCK = 16


class RecordingOps(ReferenceOps):
    def __init__(self) -> None:
        self.widths: list[int] = []

    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        self.widths.append(meta.block_tables.shape[1])
        return super().prefill_attention(q, kv_layer, meta, scale)

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        self.widths.append(meta.block_tables.shape[1])
        return super().decode_attention(q, kv_layer, meta, scale)


def test_tables_padded_and_batch_invariant() -> None:
    torch.set_num_threads(1)
    ops = RecordingOps()
    cfg = EngineConfig(model="dummy:tiny", cuda_graphs=False, max_model_len=512)
    runner = ModelRunner(tiny_loaded(torch.device("cpu")), cfg, 64, max_model_len=512, ops=ops)
    gen = torch.Generator().manual_seed(0)
    lens = (5, 40, 290)  # 1, 3 and 19 blocks
    prompts = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in lens]
    tables = [[0], [40, 41, 42], list(range(16, 35))]
    new = (1, 1, 10)  # two decodes and a prefill chunk: the mixed batch runs prefill attention
    for p, t, k in zip(prompts, tables, new, strict=True):  # each prompt's KV up to its new tokens, alone
        runner.execute([BatchItem(p, 0, len(p) - k, t, False)])
    items = [BatchItem(p, len(p) - k, k, t, True) for p, t, k in zip(prompts, tables, new, strict=True)]
    alone = [runner.execute([it]) for it in items]
    mixed = runner.execute(items)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-4, atol=1e-4)
    assert ops.widths and all(w % TABLE_ALIGN == 0 for w in ops.widths), ops.widths
    assert {16, 32} <= set(ops.widths), ops.widths


def test_warm_up_runs_prefill_paths_and_writes_no_kv() -> None:
    # The GPU runner calls warm_up at construction to compile its kernels; it must leave the pool as it was.
    torch.set_num_threads(1)
    ops = RecordingOps()
    cfg = EngineConfig(model="dummy:tiny", cuda_graphs=False, max_model_len=2048)
    runner = ModelRunner(tiny_loaded(torch.device("cpu")), cfg, 64, max_model_len=2048, ops=ops)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    before = runner.kv_cache.clone()
    runner.warm_up(2048)
    assert torch.equal(runner.kv_cache, before)
    # a short prompt, then 16 tokens over 1,024 and 2,048 (the longer contexts pass max_model_len)
    assert sorted(ops.widths) == [16] * 2 + [64] * 2 + [128] * 2, ops.widths


def test_cpu_prefill_steps_reuse_freed_memory() -> None:
    # glibc's malloc handed a step's large activations back to the OS as they were freed (a mapping per
    # block over its mmap threshold, a trimmed heap top), so every step faulted them in again page by page:
    # 408k page faults and 0.85 s of system time in a 1,650-token SmolLM2 prefill of 6 s (issue 31). After
    # the first step, later prefills of the same size find the memory they need already mapped.
    torch.set_num_threads(1)
    n = 1024
    cfg = EngineConfig(model="dummy:tiny", cuda_graphs=False, max_model_len=n)
    runner = ModelRunner(tiny_loaded(torch.device("cpu")), cfg, n // BLOCK, max_model_len=n)
    gen = torch.Generator().manual_seed(0)
    blocks = list(range(n // BLOCK))
    faults = []
    for _ in range(4):  # the first step maps what the later ones reuse
        prompt = torch.randint(1, 500, (n,), generator=gen).tolist()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        runner.execute([BatchItem(prompt, 0, n, blocks, True)])
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    # A later step that reuses nothing faults its activations in again: about 6,300 pages here, 18,900 over
    # the three (one layer's gate/up output alone is 1,024 x 3,072 fp32 = 3,072 pages). With reuse they fault
    # 0, but the heap may still grow once while it settles (a free fragment too small for the next step's
    # largest block): up to 2,113 pages seen in one later step.
    assert sum(faults[1:]) < 6000, faults
