"""Qwen3, Qwen3-MoE and Mixtral served by a real 1P+1D cluster (redis-server, router, a prefill and a decode
node, one torch thread each): the official `openai` client gets the text `pdserve generate` gives for the
same prompt (greedy), every pool is back to empty afterwards, and `kvctl nodes` names each node's model.
The tiny seeded checkpoints (tests/harness/tiny_models.py) carry SmolLM2's tokenizer, saved beside them
from conftest's `hf_smollm2`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import openai
import pytest
from pdserve.cli.up import UpConfig, free_port
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl
from pdserve.tests.harness.hf_reference import HFSmolLM2
from pdserve.tests.harness.tiny_models import save_tiny_checkpoint

pytestmark = pytest.mark.slow
PROMPT = "The three primary colors are"
MAX_TOKENS = 12


def _offline_text(model: str) -> str:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--threads", "1", "--model", model,
           "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--kv-cache-gib", "0.01"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text: str = json.loads(proc.stdout.splitlines()[-1])["text"]
    return text


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_cluster_serves_the_offline_text(
    family: str, hf_smollm2: Callable[[], HFSmolLM2], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = str(tmp_path_factory.mktemp(f"{family}-served"))
    save_tiny_checkpoint(family, path, hf_smollm2().saved_dir)
    expected = _offline_text(path)
    cfg = UpConfig(
        model=path, port=free_port(), threads_per_node=1, extra_node_args=("--kv-cache-gib", "0.01")
    )
    with LiveCluster.start(cfg) as live:
        with openai.OpenAI(
            base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            name = client.models.list().data[0].id
            done = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert done.choices[0].text == expected, (done.choices[0].text, expected)
        live.wait_clean()
        nodes = kvctl(live.redis_url, "nodes")["nodes"]
        assert sorted(n["info"]["role"] for n in nodes) == ["decode", "prefill"]
        assert {n["info"]["model"] for n in nodes} == {f"{family} {path.rstrip('/').rsplit('/', 1)[-1]}"}
