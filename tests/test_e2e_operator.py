"""End to end, as an operator runs it: a P/D cluster started like `pdserve up` (served-model aliases, API
keys and the transfer token from the environment, a stats line every second). No secret is on any
process's command line (`ps`); every vLLM-vocabulary series the operator's issue names is on the nodes'
/metrics with a model_name label, with process metrics and no `_created` series; the official client's
`models.retrieve()` works behind the API key; a node is drained and undrained with kvctl and serves again.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator

import httpx2
import openai
import pytest
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl, model_path, sample, up_config

pytestmark = pytest.mark.slow

API_KEY = "operator-key-7c1f"
NAMES = ("smol", "smol-latest")
ENGINE_SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total")  # fmt: skip
DECODE_SERIES = ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "request_time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_decode_time_seconds_count", "request_prompt_tokens_count",
                 "request_generation_tokens_count", "request_success_total")  # fmt: skip
PREFILL_SERIES = ("request_queue_time_seconds_count", "request_prefill_time_seconds_count")


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    saved = os.environ.get("PDSERVE_API_KEYS")
    os.environ["PDSERVE_API_KEYS"] = f"other-key,{API_KEY}"  # the router inherits it; argv never has it
    try:
        cfg = up_config(
            extra_node_args=("--log-stats-interval-s", "1", "--served-model-name", NAMES[0]),
            router_args=("--served-model-name", ",".join(NAMES)),
        )
        cluster = LiveCluster.start(cfg)
    finally:
        if saved is None:
            os.environ.pop("PDSERVE_API_KEYS")
        else:
            os.environ["PDSERVE_API_KEYS"] = saved
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(live: LiveCluster) -> Iterator[openai.OpenAI]:
    with live.openai(API_KEY) as c:
        yield c


def test_no_secret_on_any_command_line(live: LiveCluster, client: openai.OpenAI) -> None:
    client.completions.create(model=NAMES[0], prompt="Secrets stay out of argv:", max_tokens=4)
    pids = [p.pid for _, p in live.cluster.procs]
    with open(f"/proc/{pids[0]}/environ", "rb") as f:  # the transfer token, as the node got it
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    token = env[b"PDSERVE_AUTH_TOKEN"].decode()
    assert len(token) >= 16
    listing = subprocess.run(["ps", "-eo", "pid,pgid,args", "--no-headers", "-ww"], capture_output=True,
                             text=True, check=True).stdout.splitlines()  # fmt: skip
    ours = [line for line in listing if int(line.split()[1]) in pids]  # each child leads its own group
    assert {int(line.split()[0]) for line in ours} >= set(pids), listing
    for secret in (token, API_KEY):  # values unique to this run: on no command line of the machine
        assert not [line for line in listing if secret in line], f"{secret[:6]}... is on a command line"
    for flag in ("--auth-token", "--api-key", "--redis-password"):
        assert not [line for line in ours if flag in line.split()], f"{flag} on one of our command lines"


def test_models_retrieve_behind_the_api_key(live: LiveCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == list(NAMES)
    for name in NAMES:
        model = client.models.retrieve(name)
        assert model.id == name and model.object == "model"
    with pytest.raises(openai.NotFoundError):  # a server path is not a model id
        client.completions.create(model=model_path(), prompt="hi", max_tokens=1)
    assert httpx2.get(f"{live.base}/v1/models", timeout=10).status_code == 401
    assert httpx2.get(f"{live.base}/v1/models/{NAMES[0]}", timeout=10).status_code == 401
    assert httpx2.get(f"{live.base}/metrics", timeout=10).status_code == 401  # no --metrics-public
    done = client.chat.completions.create(
        model=NAMES[1], messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0
    )
    assert done.model == NAMES[0] and done.choices[0].message.content  # an alias answers as the first name


def test_vllm_series_with_model_name(live: LiveCluster, client: openai.OpenAI) -> None:
    client.completions.create(model=NAMES[0], prompt="Metrics, in vLLM's words:", max_tokens=6)
    labels = {"model_name": NAMES[0]}
    texts = {
        n: httpx2.get(f"{live.nodes[n].url}/metrics", timeout=10).text for n in ("prefill-0", "decode-0")
    }
    for node, text in texts.items():
        for series in ENGINE_SERIES:  # each with the label, whatever its value (preemptions may be 0)
            assert re.search(rf'^vllm:{series}{{[^}}]*model_name="smol"[^}}]*}} ', text, re.M), (node, series)
        assert sample(text, "process_cpu_seconds_total") > 0 and "process_resident_memory_bytes" in text
        assert "_created" not in text, node
    for series in DECODE_SERIES:
        assert sample(texts["decode-0"], f"vllm:{series}", labels) >= 1, series
    for series in PREFILL_SERIES:
        assert sample(texts["prefill-0"], f"vllm:{series}", labels) >= 1, series
    assert sample(texts["decode-0"], "vllm:generation_tokens_total", labels) >= 6
    assert sample(texts["prefill-0"], "vllm:prefix_cache_queries_total", labels) > 0
    assert 0 <= sample(texts["decode-0"], "vllm:kv_cache_usage_perc", labels) <= 1
    key = {"authorization": f"Bearer {API_KEY}"}  # the router's /metrics asks for it (no --metrics-public)
    router = httpx2.get(f"{live.base}/metrics", headers=key, timeout=10).text
    assert "_created" not in router and "process_cpu_seconds_total" in router
    assert "pdserve_router_e2e_request_latency_seconds_count" in router
    assert "pdserve_node_e2e_request_latency_seconds_count" in texts["decode-0"]
    assert "Avg prompt throughput:" in live.log("decode-0") and "KV cache usage:" in live.log("prefill-0")


def test_drain_then_undrain_serves_again(live: LiveCluster, client: openai.OpenAI) -> None:
    kvctl(live.redis_url, "drain", "decode-0")
    deadline = time.monotonic() + 30
    while any(n["info"]["node_id"] == "decode-0" for n in kvctl(live.redis_url, "nodes")["nodes"]):
        assert time.monotonic() < deadline, "the drained, idle decode node did not leave the index"
        time.sleep(0.5)
    reply = kvctl(live.redis_url, "undrain", "decode-0", "--url", live.nodes["decode-0"].url)
    assert reply["node_reply"]["draining"] is False and reply["node_reply"]["epoch"] == 2
    deadline = time.monotonic() + 30
    while True:
        nodes = {n["info"]["node_id"]: n for n in kvctl(live.redis_url, "nodes")["nodes"]}
        if "decode-0" in nodes and not nodes["decode-0"]["draining"]:
            break
        assert time.monotonic() < deadline, f"decode-0 is not back in the index: {sorted(nodes)}"
        time.sleep(0.5)
    time.sleep(1.5)  # the router's node list is reused for up to a second
    done = client.completions.create(model=NAMES[0], prompt="Back in service:", max_tokens=4)
    assert done.choices[0].text is not None
    live.wait_clean()
