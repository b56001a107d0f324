"""`kvctl drain NODE --move-prefixes`: before the node drains, its hottest cached prefixes go to the nodes the
router would send them to next, so their next requests hit a cache instead of a cold prefill.

How: the draining node names its hottest chains up to the byte budget (node/prefix_move.py); for each chain,
the router's own policy (router/policy.py `choose`, over the live nodes' loads and the index's prefix hits,
the draining node left out) names the node of the draining node's role that would take a prompt starting
with it; that node pulls the chain from the draining node through the prefix-fetch path (node/kv_fetch.py)
and publishes it to the index as any block it stores, so routers see the new holder.
Invariants: nothing here changes what the drain itself does (the caller drains the node afterwards, as a
plain drain does); a chain with no target, or whose target has no room, is skipped with its reason; when no
chain moves, `degraded` says why in one line and the drain is a plain one.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import httpx2
from pdserve.router.policy import NodeView, NoNodeAvailable, choose
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeStatus
from pdserve.shared.node.move_protocol import HotPrefixes, HotPrefixesRequest, PullPrefix, PullResult
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import BlockHash, NodeId
from pdserve.shared.wire import WireError


class MoveError(Exception):
    """The draining node could not say which prefixes are hot (unreachable, or it refused)."""


def target(chain_blocks: int, block_size: int, hits: dict[NodeId, int], draining: NodeStatus,
           others: list[NodeStatus]) -> NodeId | None:  # fmt: skip
    """The node of the draining node's role the router's policy would pick for a prompt that starts with
    the chain (one token past it), or None when the policy would send it to no node of that role."""
    views = [NodeView.from_status(s) for s in others if not s.draining]
    try:
        decision = choose(chain_blocks, chain_blocks * block_size + 1, hits, views, rotation=0,
                          block_size=block_size)  # fmt: skip
    except NoNodeAvailable:
        return None
    node = decision.prefill if draining.info.role == "prefill" else decision.decode
    role = next((v.role for v in views if v.node_id == node), None)
    return node if role == draining.info.role else None


async def move_prefixes(
    index: BlockIndex,
    draining: NodeStatus,
    budget_bytes: int,
    timeout_s: float,
    token: str,
    url: str | None = None,
) -> dict[str, Any]:
    """Moves the draining node's hottest prefixes; returns what moved, per chain, and `degraded` (None, or
    why nothing moved). `timeout_s` bounds the whole move; `url` is where kvctl reaches the draining node
    (default: its registered URL, which the receivers always use)."""
    deadline = time.time() + timeout_s
    node = draining.info.node_id
    async with httpx2.AsyncClient(timeout=timeout_s, auth=signed(token)) as client:
        holder = draining.info.http_url.rstrip("/")
        url = (url or holder).rstrip("/")
        try:
            reply = await client.post(f"{url}/internal/hot-prefixes",
                                      content=HotPrefixesRequest(budget_bytes).to_json())  # fmt: skip
            reply.raise_for_status()
            hot = HotPrefixes.from_json(reply.content)
        except (httpx2.HTTPError, WireError) as exc:
            raise MoveError(f"node {node!r} at {url} did not list its hot prefixes: {exc!r}"[:300]) from exc
        others = [s for s in await index.nodes() if s.info.node_id != node]
        rows: list[dict[str, Any]] = []
        for chain in hot.chains:
            hashes = [BlockHash(h) for h in chain.block_hashes]
            hits = {n: b for n, b in (await index.lookup(hashes)).items() if n != node}
            row: dict[str, Any] = {"blocks": len(hashes), "hits": chain.hits, "idle_s": chain.idle_s,
                                   "target": None, "moved_blocks": 0, "bytes": 0,
                                   "no_room": False}  # fmt: skip
            rows.append(row)
            to = target(len(hashes), hot.block_size, hits, draining, others)
            if to is None:
                row["skipped"] = f"no other live {draining.info.role} node would take it"
                continue
            row["target"] = to
            if hits.get(to, 0) >= len(hashes):
                row["skipped"] = f"{to} holds it already"
                continue
            status = next(s for s in others if s.info.node_id == to)
            pull = PullPrefix(NodeId(node), holder, tuple(hashes), deadline)
            try:
                got = await client.post(f"{status.info.http_url.rstrip('/')}/internal/pull-prefix",
                                        content=pull.to_json())  # fmt: skip
                result = PullResult.from_json(got.content)
            except (httpx2.HTTPError, WireError) as exc:
                row["skipped"] = f"{to} could not pull it: {exc!r}"[:300]
                continue
            row["moved_blocks"], row["bytes"] = result.landed_blocks, result.bytes_moved
            row["no_room"] = result.no_room
            if result.error is not None:
                row["skipped"] = f"{to}: {result.error}"
    moved = [r for r in rows if r["moved_blocks"]]
    degraded = None
    if not moved:
        reasons = Counter(r.get("skipped", "") for r in rows if r.get("skipped"))
        if not rows:
            degraded = (f"node {node!r} named no hot prefix within {budget_bytes} bytes (it counts a "
                        "prefix's hits as prompts match its cache): nothing to move")  # fmt: skip
        elif reasons:
            degraded = "; ".join(f"{why} ({n} prefixes)" for why, n in reasons.most_common(3))
    return {
        "prefixes_moved": len(moved),
        "blocks_moved": sum(r["moved_blocks"] for r in rows),
        "bytes_moved": sum(r["bytes"] for r in rows),
        "budget_bytes": budget_bytes,
        "chains": rows,
        "degraded": degraded,
    }
