"""End to end: nodes that must not exchange KV are refused cleanly. A decode node started with another
transfer token (PDSERVE_AUTH_TOKEN) cannot join the prefill node's cluster (tests/test_serving_regressions.py
shows it refused at registration), so here it runs in a cluster of its own (`--cluster isolated`); the
prefill node, asked directly to send it a prefill, fails the transfer handshake: the request ends with an
error well within its deadline (never a hang), both sides log the handshake's refusal, and neither pool keeps
a block. A decode node with another KV layout (--block-size 32, or --kv-cache-dtype fp8) is refused at
registration with a message naming the field. The processes are built by hand with `Cluster.spawn` and the
command lines `start_cluster` uses; teardown asserts none is left.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator

import httpx2
import pytest
from pdserve.cli.up import Cluster, free_port, start_redis
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeStatus, RedisConfig
from pdserve.shared.node.node_protocol import PrefillRequest, PrefillResult
from pdserve.shared.node.node_sign import ClusterKeys, signed
from pdserve.shared.types import RequestId
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    """Redis, a prefill node with token A, and a decode node with token B in a cluster of its own."""
    cluster = Cluster(auth_token="token-a")
    with cluster_fixture.stopped_on_failure(cluster):
        redis_url = start_redis(cluster)
        nodes = {}
        for role, token, extra in (
            ("prefill", "token-a", ()),
            ("decode", "token-b", ("--cluster", "isolated")),
        ):
            name, port = f"{role}-0", free_port()
            cluster.spawn(name, cluster_fixture.node_argv(role, name, port, redis_url, token, *extra))
            nodes[name] = cluster_fixture.NodeProc(name, f"http://127.0.0.1:{port}", token)
        for node in nodes.values():
            cluster.wait_http(f"{node.url}/internal/health", timeout_s=300)
        live = cluster_fixture.LiveCluster(cluster, "", redis_url, nodes)
    try:
        yield live
    finally:
        live.stop()


def test_transfer_handshake_with_another_token_fails_cleanly(live: cluster_fixture.LiveCluster) -> None:
    """The prefill node asked directly, as the router would: its transfer to D fails the HMAC challenge."""

    async def isolated() -> list[
        NodeStatus
    ]:  # its records are signed with token B, as an operator of it reads
        config = RedisConfig(url=live.redis_url, cluster="isolated")
        async with BlockIndex(config, ClusterKeys("token-b")) as index:
            return await index.nodes()

    (decode,) = [s.info for s in asyncio.run(isolated())]
    pre = PrefillRequest(
        RequestId(f"mismatch-{os.getpid()}"), (1, 2, 3, 4, 5), SamplingParams(max_tokens=4), None,
        time.time() + 60, decode.node_id, decode.transfer_addr,
    )  # fmt: skip
    url = f"{live.nodes['prefill-0'].url}/internal/prefill"
    t0 = time.monotonic()
    r = httpx2.post(url, content=pre.to_json(), auth=signed("token-a"), timeout=90)
    took = time.monotonic() - t0
    result = PrefillResult.from_json(r.content)
    assert result.error is not None and ("handshake" in result.error or "auth" in result.error), r.text
    assert took < 30, f"the refused transfer took {took:.1f}s (deadline 60 s): it waited instead of failing"
    live.wait_clean(timeout_s=20)
    prefill_log, decode_log = live.log("prefill-0"), live.log("decode-0")
    assert "failed the HMAC challenge" in prefill_log, prefill_log[-2000:]
    assert "refused sender" in decode_log and "HMAC" in decode_log, decode_log[-2000:]


@pytest.fixture(scope="module")
def block_size_32(live: cluster_fixture.LiveCluster) -> tuple[int, str]:
    """Starts a decode node with --block-size 32 beside the block-size-16 nodes; its exit code and log."""
    return refused_node(live, "decode-bs32", "--block-size", "32")


def refused_node(live: cluster_fixture.LiveCluster, name: str, *extra: str) -> tuple[int, str]:
    """Starts decode node `name` with `extra` arguments beside the cluster's nodes and waits for it to exit
    (failing the test if it keeps running); its exit code and log."""
    argv = cluster_fixture.node_argv("decode", name, free_port(), live.redis_url, "token-a", *extra)
    proc = live.cluster.spawn(name, argv)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node {name} ({' '.join(extra)}) kept running:\n{live.log(name)[-2000:]}")
    return proc.returncode, live.log(name)


def test_incompatible_block_size_is_refused_at_registration(
    live: cluster_fixture.LiveCluster, block_size_32: tuple[int, str]
) -> None:
    returncode, log = block_size_32
    assert returncode != 0
    assert "IncompatibleNode" in log and "refused by cluster" in log, log[-2000:]
    listed = [n["info"]["node_id"] for n in cluster_fixture.kvctl(live.redis_url, "nodes")["nodes"]]
    assert "decode-bs32" not in listed


def test_block_size_refusal_names_the_field(block_size_32: tuple[int, str]) -> None:
    _, log = block_size_32
    refusal = next(line for line in log.splitlines() if "refused by cluster" in line)
    assert "block_size is 32" in refusal, refusal


def test_a_decode_node_with_another_kv_dtype_is_refused_at_registration(
    live: cluster_fixture.LiveCluster,
) -> None:
    """A decode node with an FP8 cache beside a prefill node with fp32's: the index's cluster record refuses
    it before it serves, in one line naming the field and both dtypes."""
    returncode, log = refused_node(live, "decode-fp8", "--kv-cache-dtype", "fp8")
    assert returncode != 0
    refusal = next(line for line in log.splitlines() if "refused by cluster" in line)
    assert "kv_layout.dtype is float8_e4m3fn on the node but float32 on the live nodes" in refusal, refusal
    listed = [n["info"]["node_id"] for n in cluster_fixture.kvctl(live.redis_url, "nodes")["nodes"]]
    assert "decode-fp8" not in listed
