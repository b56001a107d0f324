"""kvctl's tables for people (rich, no colours or box lines when stdout is not a terminal, never wrapped);
`--json` prints the same results as JSON instead. One function per command, over commands.py's dicts."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    t = Table(*headers, box=None, pad_edge=False, show_edge=False, header_style="bold")
    for row in rows:
        t.add_row(*(str(c) for c in row))
    out = io.StringIO()
    tty = sys.stdout.isatty()
    Console(file=out, width=1000, force_terminal=tty, no_color=not tty).print(t, crop=False, soft_wrap=True)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def _nodes(result: dict[str, Any]) -> str:
    rows = []
    for n in result["nodes"]:
        info, load = n["info"], n["load"] or {}
        total, used = load.get("kv_total_blocks", 0), load.get("kv_used_blocks", 0)
        kv = f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"
        tp, devices = info["kv_layout"].get("tp_size", 1), ",".join(info.get("devices", ())) or "-"
        rows.append([info["node_id"], info["role"], tp, devices, info["epoch"],
                     "draining" if n["draining"] else "ready",
                     load.get("running", "-"), load.get("waiting", "-"), kv, load.get("blocks_held", "-"),
                     n["blocks_indexed"], info.get("quantization", "none"), info["kv_layout"]["dtype"],
                     f"{n['heartbeat_age_s']:.1f}s", info["http_url"], info.get("model") or "-"])  # fmt: skip
    headers = [
        "NODE",
        "ROLE",
        "TP",
        "DEVICES",
        "EPOCH",
        "STATE",
        "RUN",
        "WAIT",
        "KV USED",
        "HELD",
        "INDEXED",
        "QUANT",
        "KV DTYPE",
        "HEARTBEAT",
        "HTTP",
        "MODEL",
    ]
    return "\n".join([table(headers, rows) if rows else "no live nodes", *_invalid(result)])


def _invalid(result: dict[str, Any]) -> list[str]:
    """One line per record the index holds that does not verify (never used by the router)."""
    return [f"INVALID {r['node_id']!r} epoch {r['epoch']}: {r['reason']}" for r in result.get("invalid", [])]


def _blocks(result: dict[str, Any]) -> str:
    if not result["nodes"]:
        return "\n".join(["no live nodes", *_invalid(result)])
    rows = [[n, b["count"], b["count"] - b["host"], b["host"]] for n, b in result["nodes"].items()]
    lines = [table(["NODE", "RECORDS", "DEVICE", "HOST"], rows)]
    lines += [f"{n} {h}" for n, b in result["nodes"].items() for h in b["hashes"]]
    return "\n".join([*lines, *_invalid(result)])


def _where(result: dict[str, Any]) -> str:
    head = f"{result['prompt_tokens']} tokens, {result['blocks']} full blocks of {result['block_size']}"
    rows = [[r["node_id"], r["role"], f"{r['prefix_blocks']}/{result['blocks']}", r["prefix_tokens"],
             r["device_blocks"], r["host_blocks"]] for r in result["nodes"]]  # fmt: skip
    headers = ["NODE", "ROLE", "PREFIX BLOCKS", "PREFIX TOKENS", "ON DEVICE", "ON HOST"]
    out = head + "\n" + table(headers, rows)
    cost = result.get("cost_model", {})
    if cost.get("estimates"):
        learned = "learned rates" if cost["learned"] else "priors: the router has published no rates yet"
        pair = f"P {cost['prefill_node']}, D {cost['decode_node']}"
        out += f"\ncost model ({learned}): {cost['choice']} ({pair})\n"
        out += table(["OPTION", "EST TTFT", "COMPUTE TOKENS", "FETCH BLOCKS"],
                     [[e["option"], f"{1000 * e['ttft_s']:.1f} ms", e["compute_tokens"], e["fetch_blocks"]]
                      for e in cost["estimates"]])  # fmt: skip
    return out


def _stats(result: dict[str, Any]) -> str:
    per_node = [*result["nodes"].items(), ("(all)", result["overall"])]
    rows = [[n, s["local_tokens"], s["remote_tokens"], s["miss_tokens"], s["total_tokens"],
             f"{100 * s['hit_rate']:.1f}%", f"{100 * s['reuse_rate']:.1f}%"]
            for n, s in per_node]  # fmt: skip
    return table(["NODE", "LOCAL", "REMOTE", "MISS", "TOTAL", "HIT", "REUSE"], rows)


def _action(result: dict[str, Any]) -> str:
    """drain, undrain, role, evict: one row of the result's plain fields and the node's reply."""
    fields = {k: v for k, v in result.items() if k != "node_reply"}
    reply = result.get("node_reply")
    if reply is not None:
        fields["node reply"] = json.dumps(reply, separators=(",", ":"))
    return table([k.upper().replace("_", " ") for k in fields], [list(fields.values())])


def _drain(result: dict[str, Any]) -> str:
    """The drain's row, then, with --move-prefixes, one row per prefix chain and what the move did."""
    moved = result.get("prefixes")
    head = _action({k: v for k, v in result.items() if k != "prefixes"})
    if moved is None:
        return head
    rows = [[r["blocks"], r["hits"], r["target"] or "-", r["moved_blocks"], r["bytes"], r.get("skipped", "")]
            for r in moved["chains"]]  # fmt: skip
    lines = [head]
    if rows:
        lines.append(table(["BLOCKS", "HITS", "TARGET", "MOVED", "BYTES", "NOTE"], rows))
    if moved["degraded"] is not None:
        lines.append(f"moved no prefix, plain drain: {moved['degraded']}")
    else:
        lines.append(f"moved {moved['prefixes_moved']} prefixes, {moved['bytes_moved']} bytes")
    return "\n".join(lines)


def _diff(result: dict[str, Any]) -> str:
    rows, lines = [], []
    for n, r in result["nodes"].items():
        if "error" in r:
            rows.append([n, "-", "-", "-", "-", "-", r["error"]])
            continue
        disagree = r["extra"] or r["missing"]
        state = ("repaired" if r["repaired"] else "stale") if disagree else "ok"
        rows.append([n, r["epoch"], r["held"], r["indexed"], r["extra"], r["missing"], state])
        lines += [f"{n} extra {h}" for h in r["extra_hashes"]]
        lines += [f"{n} missing {h}" for h in r["missing_hashes"]]
    if not rows:
        return "no live nodes"
    head = table(["NODE", "EPOCH", "HELD", "INDEXED", "EXTRA", "MISSING", "STATE"], rows)
    return "\n".join([head, *lines])


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "diff": _diff,
    "nodes": _nodes,
    "blocks": _blocks,
    "where": _where,
    "stats": _stats,
    "drain": _drain,
    "undrain": _action,
    "role": _action,
    "evict": _action,
}


def render(command: str, result: dict[str, Any]) -> str:
    return RENDERERS[command](result)
