"""The internal routes every node serves whatever its role (info, health, challenge, audit, abort, drain,
undrain, evict, metrics), over the node's runtime.

Invariants: they live on the node's internal port, never the public API, and all but health and metrics
need the cluster's credential (shared/node/node_auth.py, in front of them); they hold no state of their own;
a body that is not the route's message is answered 400 naming the problem (`BadBody`), never 500.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.node.move_protocol import DrainNote
from pdserve.shared.node.node_protocol import AbortRequest, ChallengeReply, ChallengeRequest, NodeInfoReply
from pdserve.shared.types import BlockHash, RequestId
from pdserve.shared.wire import JsonMessage
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)
M = TypeVar("M", bound=JsonMessage)


class BadBody(ValueError):
    """An internal request's body is not the route's message: the caller's error, answered 400."""


async def message_body(request: Request, cls: type[M]) -> M:
    """The request's body decoded as `cls` with the one codec, or BadBody naming what is wrong."""
    try:
        return cls.from_json(await request.body())
    except ValueError as exc:
        raise BadBody(f"the body is not a {cls.__name__}: {exc}") from exc


def _bad_body(_request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=400)


def _evict_targets(body: bytes) -> list[BlockHash] | None:
    """/internal/evict's body, {"all": true} (None: everything) or {"block_hashes": [hex, ...]}."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or not isinstance(data.get("all", False), bool):
            raise ValueError('expected {"all": true} or {"block_hashes": [hex, ...]}')
        if data.get("all"):
            return None
        hashes = data.get("block_hashes", [])
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise ValueError("block_hashes must be a list of hex strings")
        return [BlockHash(bytes.fromhex(h)) for h in hashes]
    except ValueError as exc:
        raise BadBody(f"the evict body is not valid: {exc}") from exc


def message_response(msg: JsonMessage, status: int = 200) -> Response:
    """A node protocol message as an internal route's reply: its codec's JSON."""
    return Response(msg.to_json(), status, media_type="application/json")


def add_common_routes(app: FastAPI, rt: NodeRuntime) -> None:
    """Internal routes every role serves. They live on the node's internal port, never the public API, and
    all but health and metrics need the cluster's credential (shared/node/node_auth.py, in front of them)."""
    app.add_exception_handler(BadBody, _bad_body)

    @app.get("/internal/info")
    async def info() -> Response:
        e = rt.engine
        reply = NodeInfoReply(
            node_id=rt.node_id,
            role=rt.role,
            model=e.cfg.model,
            max_model_len=e.max_model_len,
            block_size=e.cfg.block_size,
        )
        return message_response(reply)

    @app.get("/internal/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True, "node_id": rt.node_id, "draining": rt.draining, "time": time.time()})

    @app.post("/internal/challenge")
    async def challenge(request: Request) -> Response:
        """Proves that this URL is served by a holder of the cluster's credential registered as (node id,
        epoch): the router asks once per epoch before it sends the node any work (router/membership.py)."""
        msg = await message_body(request, ChallengeRequest)
        answer = rt.keys.challenge_answer(msg.nonce, rt.node_id, rt.epoch)
        reply = ChallengeReply(node_id=rt.node_id, epoch=rt.epoch, answer=answer)
        return message_response(reply)

    @app.get("/internal/audit")
    async def audit() -> JSONResponse:
        e = rt.engine
        a, live, matchers = await rt.aengine.call(lambda: (e.audit(), e.num_requests(), e.grammar_matchers()))
        return JSONResponse(
            {
                "num_blocks": a.num_blocks,
                "free": a.free,
                "cached": a.cached,
                "in_use": a.in_use,
                "reserved": a.reserved,
                "live_requests": live,
                "grammar_matchers": matchers,
            }
        )

    @app.post("/internal/abort")
    async def abort(request: Request) -> JSONResponse:
        msg = await message_body(request, AbortRequest)
        await rt.aengine.abort(RequestId(msg.request_id))
        return JSONResponse({"ok": True})

    @app.post("/internal/drain")
    async def drain(request: Request) -> JSONResponse:
        plain = (await request.body()).strip() in (b"", b"{}")
        note = None if plain else await message_body(request, DrainNote)
        await rt.drain()
        migrated = await rt.mover.migrate_running() if note is not None and note.migrate else 0
        if note is not None and note.why_not is not None:
            log.warning("node %s draining without moving its prefixes (a plain drain): %s", rt.node_id,
                        note.why_not)  # fmt: skip
        elif note is not None and note.moved_prefixes:
            log.info("node %s draining: moved %d prefixes (%d bytes) to the nodes that take them next",
                     rt.node_id, note.moved_prefixes, note.moved_bytes)  # fmt: skip
        if migrated:
            log.info("node %s draining: %d running requests move to other nodes with their KV", rt.node_id,
                     migrated)  # fmt: skip
        return JSONResponse({"ok": True, "draining": True, "migrated": migrated})

    @app.post("/internal/undrain")
    async def undrain() -> JSONResponse:
        await rt.undrain()
        return JSONResponse({"ok": True, "draining": False, "epoch": rt.epoch})

    @app.post("/internal/evict")
    async def evict(request: Request) -> JSONResponse:
        n = await rt.evict(_evict_targets(await request.body()))
        return JSONResponse({"ok": True, "evicted": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
