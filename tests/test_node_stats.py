"""The engine's snapshot, read as the node's stats loop reads it, on the real SmolLM2 GGUF (CPU): the queued
prefill tokens that the prefill pool's autoscaler scales on (`pdserve_node_queued_prefill_tokens`) count the
prompt tokens not computed yet, falling as chunked prefill advances, and one per decoding request; each engine
gauge shows the snapshot field it is named for."""

from __future__ import annotations

import pytest
import torch
from pdserve.node.node_metrics import NodeMetrics
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import EngineSnapshot, LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import RequestId

pytestmark = pytest.mark.slow
CHUNK = 64


def test_queued_prefill_tokens_follow_chunked_prefill() -> None:
    torch.set_num_threads(1)
    engine = LLMEngine(
        EngineConfig(model=default_model_path(), num_kv_blocks=64, max_num_batched_tokens=CHUNK)
    )
    prompts = [list(range(100, 100 + 150)), list(range(300, 300 + 40))]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(engine.new_request(RequestId(f"r{i}"), ids, params))
    snap = engine.snapshot()
    assert (snap.waiting, snap.running, snap.queued_prefill_tokens) == (2, 0, 190)
    engine.step()  # the first CHUNK tokens of r0
    assert engine.snapshot().queued_prefill_tokens == 190 - CHUNK
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    snap = engine.snapshot()
    assert snap.running == 2 and snap.queued_prefill_tokens == 2, "one token per decoding request"
    while engine.has_unfinished():
        engine.step()
    assert engine.snapshot().queued_prefill_tokens == 0


def test_each_engine_gauge_shows_its_snapshot_field() -> None:
    metrics = NodeMetrics("decode")
    metrics.engine_counts(
        EngineSnapshot(running=1, waiting=2, kv_used_blocks=3, kv_total_blocks=4, queued_prefill_tokens=5)
    )
    text = metrics.render().decode()
    series_by_value = ("running_requests", "waiting_requests", "kv_used_blocks", "kv_total_blocks",
                       "queued_prefill_tokens")  # fmt: skip
    for value, series in enumerate(series_by_value, 1):
        assert f"pdserve_node_{series} {value:.1f}\n" in text, series
