"""The node's periodic engine stats: every second a snapshot read on the engine thread refreshes the
metrics (running, waiting, KV use, queued prefill tokens, preemptions), and every `interval_s` one log line
says what vLLM's does: throughput since the last line, requests running and waiting, KV use and the
prefix-cache hit rate.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.engine.engine import EngineSnapshot

log = logging.getLogger("pdserve.stats")
REFRESH_S = 1.0


def stats_line(prev: EngineSnapshot, now: EngineSnapshot, seconds: float) -> str:
    """One line on the engine between two snapshots `seconds` apart."""
    prompt = now.computed_prompt_tokens - prev.computed_prompt_tokens
    generated = (now.computed_tokens - now.computed_prompt_tokens) - (
        prev.computed_tokens - prev.computed_prompt_tokens
    )
    cached = now.cached_prompt_tokens - prev.cached_prompt_tokens
    hit = 100 * cached / (cached + prompt) if cached + prompt else 0.0
    return (
        f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
        f"Running: {now.running} reqs, Waiting: {now.waiting} reqs, "
        f"KV cache usage: {100 * now.kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%, "
        f"Preemptions: {now.preemptions - prev.preemptions}"
    )


async def stats_loop(rt: NodeRuntime, interval_s: float) -> None:
    """Refreshes the metrics' snapshot every second and logs a stats line every interval_s (0: never)."""
    m = rt.metrics
    logged, last_line = m.engine, time.monotonic()
    while True:
        snap = await rt.aengine.call(rt.engine.snapshot)
        m.engine = snap
        m.engine_counts(snap)
        now = time.monotonic()
        if interval_s > 0 and now - last_line >= interval_s:
            log.info("%s", stats_line(logged, snap, now - last_line))
            logged, last_line = snap, now
        await asyncio.sleep(min(REFRESH_S, interval_s) if interval_s > 0 else REFRESH_S)
