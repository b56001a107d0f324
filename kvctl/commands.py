"""What each kvctl command does, as async functions returning plain JSON-able dicts (cli.py prints them;
render.py makes the tables).

Invariants: a command reads the index through `BlockIndex` only and reaches nodes only through their
registered `http_url` (or, for undrain, the URL the `pdserve up` cluster file names), signing each call
with the cluster's credential (never sending it); only records whose signature verifies count as nodes, the
others are listed as `invalid` by `nodes` and `blocks`; block hashes of a prompt use the cluster's recorded
fingerprint and block size, so they are the hashes the router computes for the same tokens and salt.
Failures raise `KvctlError`
(one line naming the bad value) or the block index's own errors; cli.py turns them into exit code 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, cast

import httpx2
from pdserve.router.cost_model import CostModel, Inputs, Rates
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import HitStats, NodeStatus
from pdserve.shared.node.node_protocol import RoleChangeRequest
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import ROLES, BlockHash, NodeId, Role
from pdserve.shared.wire import WireError

if TYPE_CHECKING:
    from pdserve.shared.model.tokenizer import Tokenizer


class KvctlError(Exception):
    """A command cannot proceed; the message is one line naming the bad value."""


def _tokenizer(source: str) -> Tokenizer:
    """A GGUF file's or an HF directory's tokenizer through `tokenizers` alone (no torch: kvctl stays quick);
    anything else (a dummy spec) through the model loader."""
    from pdserve.shared.model.tokenizer import Tokenizer

    try:
        if os.path.isdir(source):
            return Tokenizer.from_hf_dir(source)
        if source.endswith(".gguf"):
            return Tokenizer.from_gguf(source)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise KvctlError(f"cannot load the tokenizer of {source}: {exc}") from exc
    from pdserve.shared.model.loader import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(source)
    except ModelLoadError as exc:
        raise KvctlError(str(exc)) from exc


def tokenize(
    model: str | None,
    prompt: str | None,
    messages: list[dict[str, Any]] | None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids as the router makes them: the prompt encoded, or the messages through the chat template
    (the model's, or `chat_template` where the cluster runs with another)."""
    tokenizer = _tokenizer(model or default_model_path())
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    try:
        if messages is not None:
            return tokenizer.apply_chat_template(messages)
        return tokenizer.encode(prompt or "", add_special_tokens=True)  # as the router encodes a prompt
    except ValueError as exc:
        raise KvctlError(str(exc)) from exc


async def prompt_hashes(
    index: BlockIndex, tokens: Sequence[int], cache_salt: str | None
) -> tuple[int, list[BlockHash]]:
    """(block size, block hashes) of tokens under the cluster's recorded fingerprint."""
    record = await index.cluster_record()
    if "model_fingerprint" not in record:
        raise KvctlError(f"cluster {index.config.cluster!r} has no recorded model: no node has registered")
    block_size = int(record["kv_layout.block_size"])
    seed = hash_seed(bytes.fromhex(record["model_fingerprint"]), cache_salt)
    return block_size, hash_blocks(tokens, block_size, seed)


async def live_node(index: BlockIndex, node_id: str) -> NodeStatus:
    statuses = await index.nodes()
    for status in statuses:
        if status.info.node_id == node_id:
            return status
    live = ", ".join(s.info.node_id for s in statuses) or "none"
    raise KvctlError(f"node {node_id!r} is not live in cluster {index.config.cluster!r}; live nodes: {live}")


async def nodes(index: BlockIndex) -> dict[str, Any]:
    listing = await index.listing()
    return {"nodes": [s.to_dict() for s in listing.live], "invalid": [r.to_dict() for r in listing.invalid]}


async def blocks(index: BlockIndex, node_id: str | None, limit: int) -> dict[str, Any]:
    if node_id is not None:
        await live_node(index, node_id)
    found = await index.blocks(NodeId(node_id) if node_id else None, limit)
    invalid = (await index.listing()).invalid
    return {
        "nodes": {
            n: {"count": b.count, "host": b.host, "hashes": [h.hex() for h in b.hashes]}
            for n, b in found.items()
        },
        "invalid": [r.to_dict() for r in invalid],
    }


async def where(index: BlockIndex, tokens: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
    block_size, hashes = await prompt_hashes(index, tokens, cache_salt)
    hits = await index.lookup(hashes)
    rows: list[dict[str, Any]] = []
    for s in await index.nodes():
        n = hits.get(s.info.node_id, 0)
        host = sum(await index.host_tier(s.info.node_id, s.info.epoch, hashes[:n]))
        rows.append(
            {
                "node_id": s.info.node_id,
                "role": s.info.role,
                "prefix_blocks": n,
                "prefix_tokens": n * block_size,
                "device_blocks": n - host,
                "host_blocks": host,
            }
        )
    rows.sort(key=lambda r: (-r["prefix_blocks"], r["node_id"]))
    raw = await index.cost_rates()
    try:
        rates = Rates() if raw is None else Rates.from_json(raw)
    except WireError:  # written by a router of another record version: the priors stand in
        raw, rates = None, Rates()
    loads = {s.info.node_id: s.load for s in await index.nodes()}

    def best(role: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["role"] == role), None)

    p, d = best("prefill"), best("decode") or best("single")
    cost: dict[str, Any] = {"learned": raw is not None, "estimates": []}
    if d is not None:
        queued = {n: (load.queued_prefill_tokens if load else 0) for n, load in loads.items()}
        holder = max(
            (r["prefix_blocks"] for r in rows if p is None or r["node_id"] != p["node_id"]), default=0
        )
        holder_d = max((r["prefix_blocks"] for r in rows if r["node_id"] != d["node_id"]), default=0)
        p_blocks, p_queue = (p["prefix_blocks"], queued.get(p["node_id"], 0)) if p else (0, 0)
        x = Inputs(len(tokens), block_size, p_blocks, d["prefix_blocks"], holder, p_queue,
                   queued.get(d["node_id"], 0), p is not None, holder_d if p is not None else 0)  # fmt: skip
        model = CostModel(rates)
        est = model.estimates(x)
        cost["estimates"] = [{"option": e.option, "ttft_s": e.ttft_s, "compute_tokens": e.compute_tokens,
                              "fetch_blocks": e.fetch_blocks} for e in est]  # fmt: skip
        cost["choice"] = model.choose(x).option
        cost["prefill_node"] = p["node_id"] if p else None
        cost["decode_node"] = d["node_id"]
    return {
        "prompt_tokens": len(tokens),
        "block_size": block_size,
        "blocks": len(hashes),
        "nodes": rows,
        "cost_model": cost,
    }


async def stats(index: BlockIndex) -> dict[str, Any]:
    """Prompt tokens per prefilling node by where their KV came from, as the nodes reported them to the
    router for the requests it placed. `hit_rate` is vLLM's (the node's own cache: the node's
    vllm:prefix_cache_hits over vllm:prefix_cache_queries); `reuse_rate` adds what was fetched from others."""
    per_node = await index.stats()
    overall = sum(per_node.values(), HitStats())

    def row(s: HitStats) -> dict[str, Any]:
        total = s.total_tokens
        hit = s.local_tokens / total if total else 0.0
        reuse = (s.local_tokens + s.remote_tokens) / total if total else 0.0
        return asdict(s) | {"total_tokens": total, "hit_rate": hit, "reuse_rate": reuse}

    return {"nodes": {n: row(s) for n, s in per_node.items()}, "overall": row(overall)}


async def diff(
    index: BlockIndex, node_id: str | None, repair: bool, timeout_s: float, token: str
) -> dict[str, Any]:
    """Each live node's records in the index against the blocks it holds (the node compares, after letting
    events in flight land: index/block_digest.py); with repair, the node fixes what disagrees. A node that
    cannot be asked gets an `error` row; `clean` is whether every node answered with no disagreement."""
    statuses = [await live_node(index, node_id)] if node_id is not None else await index.nodes()
    rows: dict[str, Any] = {}
    async with httpx2.AsyncClient(timeout=timeout_s, auth=signed(token)) as client:
        for status in statuses:
            url = status.info.http_url.rstrip("/") + "/internal/index-diff"
            try:
                if repair:
                    reply = await client.post(url, json={"repair": True})
                else:
                    reply = await client.get(url)
                reply.raise_for_status()
                rows[status.info.node_id] = reply.json()
            except (httpx2.HTTPError, ValueError) as exc:
                rows[status.info.node_id] = {"node_id": status.info.node_id, "error": f"{url}: {exc!r}"[:300]}
    clean = all("error" not in r and r["extra"] == 0 and r["missing"] == 0 for r in rows.values())
    return {"nodes": rows, "clean": clean, "repair": repair}


async def _post(
    node_id: str, base_url: str, path: str, body: dict[str, Any], timeout_s: float, token: str
) -> Any:
    """POST to a node's internal API, signed with the cluster's credential (`token`)."""
    url = base_url.rstrip("/") + path
    try:
        async with httpx2.AsyncClient(timeout=timeout_s, auth=signed(token)) as client:
            reply = await client.post(url, json=body)
            reply.raise_for_status()
    except httpx2.HTTPStatusError as exc:
        text = exc.response.text.strip().replace("\n", " ")[:200]
        raise KvctlError(f"node {node_id!r} at {url} answered {exc.response.status_code}: {text}") from exc
    except httpx2.HTTPError as exc:
        raise KvctlError(f"node {node_id!r} at {url} is unreachable: {exc!r}") from exc
    return reply.json() if reply.content else {}


async def drain(
    index: BlockIndex,
    node_id: str,
    timeout_s: float,
    token: str,
    url: str | None = None,
    move_budget_bytes: int | None = None,
    move_timeout_s: float = 60.0,
    migrate: bool = False,
) -> dict[str, Any]:
    """Ask the node to drain: it marks itself draining in the index at once (a signed heartbeat; the router
    gives it no new work), finishes its work and deregisters. With `move_budget_bytes`, its hottest prefixes
    (up to that many bytes) first move to the nodes that would take them next (kvctl/move_prefixes.py); when
    none can, the drain is a plain one and `prefixes.degraded` (and the node's log) says why. With `migrate`,
    its running requests move to other nodes with their KV (node/drain_migrate.py): the node's reply says
    how many (`node_reply.migrated`)."""
    from pdserve.shared.node.move_protocol import DrainNote

    status = await live_node(index, node_id)
    body: dict[str, Any] = {}
    moved: dict[str, Any] | None = None
    if move_budget_bytes is not None:
        from pdserve.kvctl.move_prefixes import MoveError, move_prefixes

        try:
            moved = await move_prefixes(index, status, move_budget_bytes, move_timeout_s, token, url)
        except MoveError as exc:
            moved = {"prefixes_moved": 0, "blocks_moved": 0, "bytes_moved": 0, "chains": [],
                     "budget_bytes": move_budget_bytes, "degraded": str(exc)}  # fmt: skip
        note = DrainNote(moved["prefixes_moved"], moved["bytes_moved"], moved["degraded"], migrate)
        body = json.loads(note.to_json())
    elif migrate:
        body = json.loads(DrainNote(migrate=True).to_json())
    reply = await _post(node_id, url or status.info.http_url, "/internal/drain", body, timeout_s, token)
    result = {"node_id": node_id, "draining": True, "node_reply": reply}
    return result if moved is None else result | {"prefixes": moved}


async def undrain(
    index: BlockIndex,
    node_id: str,
    timeout_s: float,
    token: str,
    url: str | None = None,
    known_url: str | None = None,
) -> dict[str, Any]:
    """Ask a drained node to take new work again: it clears its draining mark in the index, or registers
    anew if it had already left. A node that left the index is reached through `url`, else `known_url` (its
    URL in the `pdserve up` cluster file)."""
    if url is None:
        try:
            url = (await live_node(index, node_id)).info.http_url
        except KvctlError as exc:
            if known_url is None:
                raise KvctlError(f"{exc}; a drained node that left the index needs --url") from exc
            url = known_url
    reply = await _post(node_id, url, "/internal/undrain", {}, timeout_s, token)
    return {"node_id": node_id, "draining": False, "node_reply": reply}


_PREFILL_CAPABLE: frozenset[str] = frozenset({"prefill", "single"})
_DECODE_CAPABLE: frozenset[str] = frozenset({"decode", "single"})


def _emptied(statuses: Sequence[NodeStatus], node_id: str, new_role: Role) -> str | None:
    """What a change of `node_id` to `new_role` would leave with no node (prefill-capable: prefill or single;
    decode-capable: decode or single), among the live nodes that take work; None if nothing."""
    before = {s.info.node_id: s.info.role for s in statuses if not s.draining or s.info.node_id == node_id}
    after = before | {node_id: new_role}
    for what, capable in (("prefill", _PREFILL_CAPABLE), ("decode", _DECODE_CAPABLE)):
        if any(r in capable for r in before.values()) and not any(r in capable for r in after.values()):
            return f"no {what}-capable node ({what} or single) taking work"
    return None


async def role(
    index: BlockIndex,
    node_id: str,
    new_role: str,
    token: str,
    *,
    force: bool = False,
    migrate: bool = False,
    timeout_s: float = 5.0,
    wait_s: float = 600.0,
    url: str | None = None,
) -> dict[str, Any]:
    """Change a live node's role (`prefill`, `decode` or `single`) at run time, keeping its prefix cache; the
    planner's entry point, as `kvctl role`. The node stops taking new work, finishes what it holds (with
    `migrate`, its running decodes end and the router continues them on other nodes), and registers under
    the new role with a new epoch. Returns once the index shows that registration (at most `wait_s`
    seconds; `timeout_s` is per call), with the node's old and new role and epoch. Refused (KvctlError)
    when the change would leave the cluster with no prefill-capable or no decode-capable node among those
    taking work, unless `force`; `token` is the cluster's credential."""
    if new_role not in ROLES:
        raise KvctlError(f"role {new_role!r}: accepted {', '.join(ROLES)}")
    statuses = await index.nodes()
    status = await live_node(index, node_id)
    emptied = _emptied(statuses, node_id, cast(Role, new_role))
    if emptied is not None and not force:
        raise KvctlError(
            f"changing node {node_id!r} from {status.info.role} to {new_role} would leave {emptied}; "
            "add --force to do it anyway"
        )
    body = json.loads(RoleChangeRequest(cast(Role, new_role), migrate).to_json())
    reply = await _post(node_id, url or status.info.http_url, "/internal/role", body, timeout_s, token)
    result = {"node_id": node_id, "from_role": status.info.role, "role": new_role,
              "from_epoch": status.info.epoch, "epoch": status.info.epoch, "node_reply": reply}  # fmt: skip
    if not reply.get("changed", False):
        return result
    deadline = time.monotonic() + wait_s
    while True:
        now = {s.info.node_id: s for s in await index.nodes()}.get(NodeId(node_id))
        if now is not None and now.info.role == new_role and now.info.epoch > status.info.epoch:
            return result | {"epoch": now.info.epoch}
        if time.monotonic() > deadline:
            raise KvctlError(
                f"node {node_id!r} did not register as {new_role} within {wait_s:.0f}s (its requests may "
                "still be running); see `kvctl nodes`"
            )
        await asyncio.sleep(0.1)


async def evict(
    index: BlockIndex,
    node_id: str,
    tokens: Sequence[int] | None,
    cache_salt: str | None,
    index_only: bool,
    timeout_s: float,
    token: str | None,
) -> dict[str, Any]:
    """Ask the node to evict a prompt's cached-free blocks (or all); index_only drops index records (and
    needs no `token`, the cluster's credential)."""
    status = await live_node(index, node_id)
    hashes = None if tokens is None else (await prompt_hashes(index, tokens, cache_salt))[1]
    if index_only:
        removed = await index.evict_records(status.info.node_id, hashes)
        return {"node_id": node_id, "index_records_removed": removed}
    if token is None:
        raise KvctlError("evicting from a node needs the cluster's credential (PDSERVE_AUTH_TOKEN)")
    body: dict[str, Any] = {"all": True} if hashes is None else {"block_hashes": [h.hex() for h in hashes]}
    reply = await _post(node_id, status.info.http_url, "/internal/evict", body, timeout_s, token)
    return {
        "node_id": node_id,
        "requested_blocks": "all" if hashes is None else len(hashes),
        "node_reply": reply,
    }
