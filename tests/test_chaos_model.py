"""The router and the nodes agree on the model (issue 20): a router whose tokenizer differs from the nodes'
(a dummy model's byte-level tokenizer) or whose checkpoint differs (the same GGUF with one metadata byte
changed: same tokenizer, another weights identity) refuses every request with 503 `model_mismatch`, naming
both fingerprints, and sends nothing to a node; nodes whose tokenizers differ are refused at registration.
Real processes: redis-server, 1 P, 1 D and three routers.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from pdserve.cli.up import free_port
from pdserve.shared.engine.block_hash import model_fingerprint
from pdserve.shared.model.gguf_loader import read_gguf
from pdserve.shared.model.loader import load_tokenizer
from pdserve.tests.harness.chaos_faults import small_cluster, start_router
from pdserve.tests.harness.chaos_load import metric_of
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl_main, model_path, served_model_name

pytestmark = pytest.mark.slow

DUMMY = "dummy:smollm2-135m"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with small_cluster(prefill=1, decode=1) as cluster:
        yield cluster


def registered(live: LiveCluster) -> dict[str, str]:
    info = kvctl_main(live.redis_url, "nodes")["nodes"][0]["info"]
    return {"model": info["model_fingerprint"], "tokenizer": info["tokenizer_fingerprint"]}


def refused(base: str, model: str) -> dict[str, str]:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4}
    r = httpx2.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    error: dict[str, str] = r.json()["error"]
    assert error["code"] == "model_mismatch", error
    return error


def test_the_routers_own_model_serves(live: LiveCluster) -> None:
    body = {"model": served_model_name(), "prompt": "Hello there", "max_tokens": 4}
    assert httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120).status_code == 200
    assert registered(live)["tokenizer"] == load_tokenizer(model_path()).fingerprint


def test_a_router_with_another_tokenizer_refuses_to_serve(live: LiveCluster) -> None:
    base = start_router(live, "router-dummy", free_port(), "--model", DUMMY)
    error = refused(base, DUMMY)
    mine = load_tokenizer(DUMMY).fingerprint
    assert mine[:16] in error["message"] and registered(live)["tokenizer"][:16] in error["message"], error
    assert metric_of(base, "pdserve_router_node_requests_total") == 0


def test_a_router_with_another_checkpoint_refuses_to_serve(live: LiveCluster, tmp_path: Path) -> None:
    other = tmp_path / "SmolLM2-other.gguf"
    shutil.copyfile(model_path(), other)
    with open(other, "r+b") as f:  # one byte of general.name: the header, so the weights identity, differs
        head = f.read(4096)
        at = head.index(b"Smollm2 135M")
        f.seek(at)
        f.write(b"T")
    config, _, identity = read_gguf(str(other))
    mine = model_fingerprint(config.to_dict(), identity, "float32", 16).hex()
    assert load_tokenizer(str(other)).fingerprint == registered(live)["tokenizer"]
    base = start_router(live, "router-other", free_port(), "--model", str(other))
    error = refused(base, other.name)
    assert mine[:16] in error["message"] and registered(live)["model"][:16] in error["message"], error
    assert metric_of(base, "pdserve_router_node_requests_total") == 0
