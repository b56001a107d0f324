"""kvctl against a real redis-server and real HTTP endpoints standing in for nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.kvctl.cli import main
from pdserve.kvctl.commands import default_model_path
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.block_pool import BlockStored, BlockTiered
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.model.loader import load_tokenizer
from pdserve.shared.node.move_protocol import DrainNote
from pdserve.shared.node.node_protocol import CODEC
from pdserve.shared.node.node_sign import SCHEME, ClusterKeys
from pdserve.shared.types import BlockHash, KVLayout, NodeId
from pdserve.tests.harness.fake_http import FakeHTTP, Seen

FP = "cd" * 32
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
TOKEN = "cluster-credential"


@pytest.fixture(autouse=True)
def credential(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvctl's node actions send the cluster's credential, read as every process reads it."""
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", TOKEN)


def node_reply(seen: Seen) -> bytes:
    """What the stand-in nodes answer every call with."""
    return json.dumps({"ok": True, "path": seen.path}).encode()


def posts(fake: FakeHTTP) -> list[tuple[str, Any]]:
    return [(s.path, json.loads(s.body or b"null")) for s in fake.seen]


def authorizations(fake: FakeHTTP) -> list[str | None]:
    return [s.headers.get("Authorization") for s in fake.seen]


Cluster = tuple[LocalRedis, FakeHTTP, list[BlockHash]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Redis with p0 (holding PROMPT's first 3 blocks and 5 random ones) and d0, both behind one FakeHTTP."""
    tokens = load_tokenizer(default_model_path()).encode(PROMPT)
    chain = hash_blocks(tokens, 16, hash_seed(bytes.fromhex(FP), None))
    fake = FakeHTTP(node_reply)

    async def setup(url: str) -> None:
        config = RedisConfig(url=url, heartbeat_ttl_s=600, records_ttl_s=600)
        async with BlockIndex(config, ClusterKeys(TOKEN)) as index:
            for name, role, tp in (("p0", "prefill", 1), ("d0", "decode", 2)):  # d0: two ranks
                layout = dataclasses.replace(LAYOUT, tp_size=tp)
                info = NodeInfo(NodeId(name), role, fake.url, "127.0.0.1:1", FP, layout, 1, 1000, "ef" * 32,  # type: ignore[arg-type]
                                8192, devices=("cpu",) * tp)  # fmt: skip
                epoch = await index.register(info, NodeLoad(1, 0, 30, 1000, 8))
                if name == "p0":
                    stored = (*chain[:3], *(BlockHash(os.urandom(32)) for _ in range(5)))
                    await index.publish(NodeId(name), epoch, [BlockStored(stored, None)])
                    # its third prefix block was evicted to its host-memory tier
                    await index.publish(NodeId(name), epoch, [BlockTiered((chain[2],), "host")])
            await index.record_hits(NodeId("p0"), 48, 16, 36)

    with LocalRedis() as server:
        asyncio.run(setup(server.url))
        yield server, fake, chain
    fake.stop()


def kvctl(capsys: pytest.CaptureFixture[str], server: LocalRedis, *argv: str) -> tuple[int, Any, str]:
    rc = main([*argv, "--redis", server.url, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if rc == 0 else out.out, out.err


def test_nodes_blocks_stats(cluster: Cluster, capsys: Any) -> None:
    server, _, chain = cluster
    rc, nodes, _ = kvctl(capsys, server, "nodes")
    assert rc == 0
    assert [(n["info"]["node_id"], n["info"]["role"], n["info"]["epoch"]) for n in nodes["nodes"]] == [
        ("d0", "decode", 1),
        ("p0", "prefill", 1),
    ]
    assert nodes["nodes"][1]["load"]["kv_used_blocks"] == 30 and nodes["nodes"][1]["blocks_indexed"] == 8
    rc, blocks, _ = kvctl(capsys, server, "blocks", "--node", "p0", "--limit", "100")
    assert rc == 0 and blocks["nodes"]["p0"]["count"] == 8 and blocks["nodes"]["p0"]["host"] == 1
    assert {h.hex() for h in chain[:3]} <= set(blocks["nodes"]["p0"]["hashes"])
    # Without --node every live node is listed with up to --limit of its hashes, as `blocks --help` says.
    rc, every, _ = kvctl(capsys, server, "blocks", "--limit", "2")
    assert rc == 0 and sorted(every["nodes"]) == ["d0", "p0"] and len(every["nodes"]["p0"]["hashes"]) == 2
    assert main(["blocks", "--help"]) == 0
    usage = " ".join(capsys.readouterr().out.split())
    assert "hashes with --node" not in usage and "--node TEXT only this node" in usage, usage
    rc, stats, _ = kvctl(capsys, server, "stats")
    assert stats["nodes"]["p0"] == {"local_tokens": 48, "remote_tokens": 16, "miss_tokens": 36,
                                    "total_tokens": 100, "hit_rate": 0.48, "reuse_rate": 0.64}  # fmt: skip
    assert stats["overall"]["total_tokens"] == 100
    assert main(["nodes", "--redis", server.url]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert (
        lines[0].split()[:6] == ["NODE", "ROLE", "TP", "DEVICES", "EPOCH", "STATE"]
        and "30/1000 (3%)" in table
    )
    assert lines[1].split()[:4] == ["d0", "decode", "2", "cpu,cpu"], lines


def test_where_tokenizes_hashes_and_looks_up(cluster: Cluster, capsys: Any) -> None:
    server, _, chain = cluster
    rc, where, _ = kvctl(capsys, server, "where", "--prompt", PROMPT)
    assert rc == 0 and where["blocks"] == len(chain) and where["block_size"] == 16
    assert where["nodes"][0] == {"node_id": "p0", "role": "prefill", "prefix_blocks": 3, "prefix_tokens": 48,
                                 "device_blocks": 2, "host_blocks": 1}  # fmt: skip
    assert where["nodes"][1]["prefix_blocks"] == 0
    cost = where["cost_model"]  # priors: no router published its rates here
    assert not cost["learned"] and (cost["prefill_node"], cost["decode_node"]) == ("p0", "d0")
    estimates = {e["option"]: e for e in cost["estimates"]}
    assert set(estimates) == {"local", "local_fetch", "pd"}  # D could fetch p0's 3 blocks
    assert estimates["local_fetch"]["fetch_blocks"] == 3 and cost["choice"] in estimates
    _, salted, _ = kvctl(capsys, server, "where", "--prompt", PROMPT, "--cache-salt", "tenant-b")
    assert all(n["prefix_blocks"] == 0 for n in salted["nodes"])
    messages = json.dumps([{"role": "user", "content": PROMPT}])
    rc, chat, _ = kvctl(capsys, server, "where", "--messages", messages)
    assert rc == 0 and chat["prompt_tokens"] > where["prompt_tokens"]  # the chat template adds tokens


def test_drain_and_evict_call_the_node(cluster: Cluster, capsys: Any) -> None:
    server, fake, chain = cluster
    fake.seen.clear()
    rc, out, _ = kvctl(capsys, server, "evict", "--node", "p0", "--prompt", PROMPT)
    assert rc == 0 and out["requested_blocks"] == len(chain)
    rc, _, _ = kvctl(capsys, server, "evict", "--node", "p0", "--all")
    assert posts(fake) == [
        ("/internal/evict", {"block_hashes": [h.hex() for h in chain]}),
        ("/internal/evict", {"all": True}),
    ]
    rc, out, _ = kvctl(capsys, server, "evict", "--node", "d0", "--all", "--index-only")
    assert rc == 0 and out["index_records_removed"] == 0 and len(posts(fake)) == 2
    rc, out, _ = kvctl(capsys, server, "drain", "d0")
    assert rc == 0 and out["node_reply"] == {"ok": True, "path": "/internal/drain"}
    rc, out, _ = kvctl(capsys, server, "drain", "d0", "--migrate")  # the node moves its running requests
    assert rc == 0 and posts(fake)[-1] == ("/internal/drain", json.loads(DrainNote(migrate=True).to_json()))
    assert all(a is not None and a.startswith(SCHEME) and TOKEN not in a for a in authorizations(fake)[-3:])
    assert len(set(authorizations(fake))) == len(authorizations(fake))  # a fresh nonce each
    _, nodes, _ = kvctl(capsys, server, "nodes")  # kvctl writes no drain flag: the node signs its own
    assert [n["draining"] for n in nodes["nodes"]] == [False, False] and nodes["invalid"] == []


def test_role_refuses_to_empty_a_role_unless_forced(cluster: Cluster, capsys: Any) -> None:
    """p0 is the only prefill-capable node and d0 the only decode-capable one: moving either empties a role
    (refused, one line, nothing sent); --force sends the change, signed, and a node that answers it had
    nothing to change ends the command at once."""
    server, fake, _ = cluster
    fake.seen.clear()
    for node, role in (("d0", "prefill"), ("p0", "decode")):
        rc, _, err = kvctl(capsys, server, "role", node, role)
        assert rc == 1 and err.count("\n") == 1 and "--force" in err and f"node '{node}'" in err, err
    assert posts(fake) == []
    rc, out, _ = kvctl(capsys, server, "role", "p0", "single", "--force", "--migrate")
    assert rc == 0 and (out["from_role"], out["role"]) == ("prefill", "single"), out
    assert posts(fake) == [("/internal/role", {"v": CODEC.version, "role": "single", "migrate": True})]
    assert authorizations(fake)[0] is not None and TOKEN not in str(authorizations(fake)[0])
    with pytest.raises(SystemExit) as exit_info:
        main(["role", "p0", "router", "--redis", server.url])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "'prefill', 'decode', 'single'" in err


def test_failures_are_one_line_and_exit_1(cluster: Cluster, capsys: Any) -> None:
    server, _, _ = cluster
    rc, _, err = kvctl(capsys, server, "drain", "ghost")
    assert rc == 1
    assert err == "kvctl drain: error: node 'ghost' is not live in cluster 'default'; live nodes: d0, p0\n"
    down = f"redis://127.0.0.1:{free_port()}/0"
    for argv in (["nodes"], ["stats"], ["blocks"], ["drain", "p0"]):
        assert main([*argv, "--redis", down, "--json"]) == 1
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1
        assert out.err.startswith(f"kvctl {argv[0]}: error: Redis at {down} is unreachable")


def test_node_actions_without_the_credential_exit_2(
    cluster: Cluster, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, fake, _ = cluster
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN")
    sent = len(posts(fake))
    for argv in (["drain", "d0"], ["undrain", "d0"], ["evict", "--node", "p0", "--all"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--redis", server.url])
        assert exit_info.value.code == 2, argv
        assert "PDSERVE_AUTH_TOKEN" in capsys.readouterr().err
    assert len(posts(fake)) == sent


def test_bad_arguments_exit_2(capsys: Any) -> None:
    for argv in (["where"], ["where", "--messages", "{not json"], ["evict", "--node", "p0"], ["nope"],
                 ["nodes", "--redis", "http://127.0.0.1:1"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
    assert "--messages is not JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs(cluster: Cluster) -> None:
    server, _, _ = cluster
    argv = [sys.executable, "-m", "pdserve.kvctl.cli", "nodes", "--redis", server.url, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and len(json.loads(done.stdout)["nodes"]) == 2


def test_undrain_calls_the_node_and_json_or_table_everywhere(cluster: Cluster, capsys: Any) -> None:
    server, fake, _ = cluster
    fake.seen.clear()
    rc, out, _ = kvctl(capsys, server, "undrain", "d0")
    assert rc == 0 and out == {"node_id": "d0", "draining": False,
                               "node_reply": {"ok": True, "path": "/internal/undrain"}}  # fmt: skip
    rc, out, _ = kvctl(capsys, server, "undrain", "gone", "--url", fake.url)  # a node that left the index
    assert rc == 0 and posts(fake) == [("/internal/undrain", {}), ("/internal/undrain", {})]
    rc, _, err = kvctl(capsys, server, "undrain", "gone")
    assert rc == 1 and err.endswith("a drained node that left the index needs --url\n")
    for argv in (["nodes"], ["blocks"], ["stats"], ["where", "--prompt", PROMPT], ["undrain", "d0"],
                 ["evict", "--node", "p0", "--all"]):  # fmt: skip
        assert main([*argv, "--redis", server.url]) == 0
        table = capsys.readouterr().out
        assert table.strip() and not table.lstrip().startswith("{"), argv
        assert main([*argv, "--redis", server.url, "--json"]) == 0
        json.loads(capsys.readouterr().out)


def test_settings_from_environment(cluster: Cluster, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server, _, _ = cluster
    monkeypatch.setenv("PDSERVE_REDIS", server.url)
    monkeypatch.setenv("PDSERVE_JSON_OUTPUT", "true")
    assert main(["nodes"]) == 0
    assert len(json.loads(capsys.readouterr().out)["nodes"]) == 2


@pytest.mark.slow
def test_closed_pipe_ends_quietly(cluster: Cluster) -> None:
    """`kvctl blocks --json | head -0`: the reader is gone before kvctl writes; no traceback, exit 1."""
    server, _, _ = cluster
    argv = [
        sys.executable,
        "-m",
        "pdserve.kvctl.cli",
        "blocks",
        "--limit",
        "100",
        "--redis",
        server.url,
        "--json",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == "", err


def test_the_emptying_rule_counts_single_for_both_roles_and_ignores_draining_nodes() -> None:
    from pdserve.kvctl.commands import _emptied
    from pdserve.shared.index.block_index_types import NodeStatus

    def node(name: str, role: str, draining: bool = False) -> NodeStatus:
        info = NodeInfo(NodeId(name), role, "http://127.0.0.1:1", "", FP, LAYOUT, 1, 1000, "ef" * 32, 8192)  # type: ignore[arg-type]
        return NodeStatus(info, None, 0.0, draining, 0)

    p0, d0, s0 = node("p0", "prefill"), node("d0", "decode"), node("s0", "single")
    assert _emptied([p0, d0], "d0", "prefill") == "no decode-capable node (decode or single) taking work"
    assert _emptied([p0, d0], "p0", "decode") == "no prefill-capable node (prefill or single) taking work"
    assert _emptied([p0, d0], "p0", "single") is None  # single counts for both
    assert _emptied([p0, d0, s0], "d0", "prefill") is None  # s0 still decodes
    assert _emptied([d0, node("d1", "decode")], "d0", "single") is None  # no prefill node to lose
    assert _emptied([p0, d0, node("d1", "decode", draining=True)], "d0", "prefill") is not None
