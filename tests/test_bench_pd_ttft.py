"""benchmarks/pd_ttft.py's `--cached` measurement on the CPU (tcp, the real SmolLM2 file, a prefill and a
decode node as processes): once P holds the prompts, "the transfer alone" must move each prompt's whole KV
into D. D kept the prompts' blocks from the first run, so without emptying its cache first the second run
moved one block per prompt while the report divided the first run's bytes by its time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets

import pytest
from pdserve.benchmarks.pd_ttft import audit, measure, start_node, stop, transfer_alone, wait_ready
from pdserve.tests.harness.cluster_fixture import model_path

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_TOKENS = 512  # 32 blocks


def test_transfer_alone_moves_the_whole_kv_of_prompts_p_holds() -> None:
    args = argparse.Namespace(model=model_path(), dtype="auto", connector="tcp", kv_cache_dtype="auto",
                              layers_per_frame=4, kv_blocks=256, prompt_tokens=PROMPT_TOKENS)  # fmt: skip
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(2)]
    token = secrets.token_hex(16)
    p_proc, p_url, _ = start_node("prefill", "prefill-0", "cpu", args, token)
    d_proc, d_url, d_tport = start_node("decode", "decode-0", "cpu", args, token)
    try:
        wait_ready(p_url, p_proc)
        wait_ready(d_url, d_proc)
        p = (p_url, f"tcp://127.0.0.1:{d_tport}")
        first = asyncio.run(measure(d_url, p, prompts, 2, "pd", token))[3]
        assert [r["transferred_blocks"] for r in first] == [PROMPT_TOKENS // BLOCK] * len(prompts)
        again = transfer_alone(d_url, p, prompts, 2, token)
        # P held every block but the last (recomputed for the first token); D held none, so all of it moved
        assert [r["cached_tokens"] for r in again] == [PROMPT_TOKENS - BLOCK] * len(prompts)
        assert [r["transferred_blocks"] for r in again] == [PROMPT_TOKENS // BLOCK] * len(prompts)
        for url in (p_url, d_url):
            au = audit(url, token)
            assert au["in_use"] == au["reserved"] == au["live_requests"] == 0, (url, au)
    finally:
        stop([p_proc, d_proc])
