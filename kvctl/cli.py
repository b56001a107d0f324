"""`kvctl`: where the KV cache lives (nodes, blocks, where, stats) and actions on it (drain, evict).

Invariants: every command takes `--redis URL`, `--cluster NAME` and `--json` (machine output on stdout);
people get tables. Exit codes: 0 done; 1 Redis or a node unreachable or refused the action (one line on
stderr); 2 bad arguments (argparse). Nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.kvctl import commands
from pdserve.shared.block_index import BlockIndex
from pdserve.shared.block_index_types import BlockIndexError, RedisConfig


def _messages(text: str) -> list[dict[str, Any]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--messages is not JSON ({exc}): {text[:60]!r}") from exc
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise argparse.ArgumentTypeError(
            f'--messages must be a JSON list of {{"role", "content"}} objects: {text[:60]!r}'
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis", default="redis://127.0.0.1:6379/0", help="redis:// or rediss:// URL of the index"
    )
    common.add_argument("--cluster", default="default", help="cluster name (key prefix) in Redis")
    common.add_argument("--tls-ca-file", help="CA bundle to verify a rediss:// server")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("--timeout", type=float, default=5.0, help="seconds per Redis or node call")
    prompt = argparse.ArgumentParser(add_help=False)
    prompt.add_argument("--model", help="model path whose tokenizer/chat template to use (default SmolLM2)")
    prompt.add_argument("--cache-salt", help="the tenant's cache salt (as in the request's cache_salt)")

    parser = argparse.ArgumentParser(prog="kvctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes", parents=[common], help="live nodes: role, epoch, load, KV use, blocks, heartbeat")
    p = sub.add_parser("blocks", parents=[common], help="block records per node (hashes with --node)")
    p.add_argument("--node", help="list this node's block hashes")
    p.add_argument("--limit", type=int, default=20, help="hashes to list per node")
    p = sub.add_parser("where", parents=[common, prompt], help="which nodes hold a prompt's prefix blocks")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (encoded as a completion prompt)")
    group.add_argument("--messages", type=_messages, help="chat messages as JSON (chat template applied)")
    sub.add_parser("stats", parents=[common], help="prefix hits local/remote/miss in tokens")
    p = sub.add_parser("drain", parents=[common], help="stop new work on a node; it finishes, then leaves")
    p.add_argument("node", help="node id")
    p = sub.add_parser("evict", parents=[common, prompt], help="evict a prompt's cached blocks from a node")
    p.add_argument("--node", required=True, help="node id")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text whose blocks to evict")
    group.add_argument("--messages", type=_messages, help="chat messages (JSON) whose blocks to evict")
    group.add_argument("--all", action="store_true", help="every cached-free block of the node")
    p.add_argument("--index-only", action="store_true", help="drop the index records only (repair)")
    return parser


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def render(command: str, result: dict[str, Any]) -> str:
    if command == "nodes":
        rows = []
        for n in result["nodes"]:
            info, load = n["info"], n["load"] or {}
            total = load.get("kv_total_blocks", 0)
            used = load.get("kv_used_blocks", 0)
            kv = f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"
            state = "draining" if n["draining"] else "ready"
            rows.append([info["node_id"], info["role"], info["epoch"], state, load.get("running", "-"),
                         load.get("waiting", "-"), kv, load.get("blocks_held", "-"), n["blocks_indexed"],
                         f"{n['heartbeat_age_s']:.1f}s", info["http_url"]])  # fmt: skip
        headers = [
            "NODE",
            "ROLE",
            "EPOCH",
            "STATE",
            "RUN",
            "WAIT",
            "KV USED",
            "HELD",
            "INDEXED",
            "HEARTBEAT",
            "HTTP",
        ]
        return _table(headers, rows) if rows else "no live nodes"
    if command == "blocks":
        lines = [_table(["NODE", "RECORDS"], [[n, b["count"]] for n, b in result["nodes"].items()])]
        lines += [f"{n} {h}" for n, b in result["nodes"].items() for h in b["hashes"]]
        return "\n".join(lines) if result["nodes"] else "no live nodes"
    if command == "where":
        head = f"{result['prompt_tokens']} tokens, {result['blocks']} full blocks of {result['block_size']}"
        rows = [[r["node_id"], r["role"], f"{r['prefix_blocks']}/{result['blocks']}", r["prefix_tokens"]]
                for r in result["nodes"]]  # fmt: skip
        return head + "\n" + _table(["NODE", "ROLE", "PREFIX BLOCKS", "PREFIX TOKENS"], rows)
    if command == "stats":
        per_node = [*result["nodes"].items(), ("(all)", result["overall"])]
        rows = [[n, s["local_tokens"], s["remote_tokens"], s["miss_tokens"], s["total_tokens"],
                 f"{100 * s['hit_rate']:.1f}%"] for n, s in per_node]  # fmt: skip
        return _table(["NODE", "LOCAL", "REMOTE", "MISS", "TOTAL", "HIT"], rows)
    return json.dumps(result, indent=2)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = RedisConfig(
        url=args.redis, cluster=args.cluster, tls_ca_file=args.tls_ca_file, socket_timeout_s=args.timeout
    )
    async with BlockIndex(config) as index:
        await index.ping()
        if args.command == "nodes":
            return await commands.nodes(index)
        if args.command == "blocks":
            return await commands.blocks(index, args.node, args.limit)
        if args.command == "stats":
            return await commands.stats(index)
        if args.command == "drain":
            return await commands.drain(index, args.node, args.timeout)
        tokens = None
        if args.command == "where" or not args.all:
            tokens = commands.tokenize(args.model, args.prompt, args.messages)
        if args.command == "where":
            assert tokens is not None
            return await commands.where(index, tokens, args.cache_salt)
        return await commands.evict(index, args.node, tokens, args.cache_salt, args.index_only, args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except ValueError as exc:
        parser.error(str(exc))
    except (BlockIndexError, commands.KvctlError) as exc:
        print(f"kvctl {args.command}: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(args.command, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
