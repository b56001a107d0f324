"""What a node tells about itself outside Redis: its registration, for a router that cannot find it in the
index (started while Redis is away, or Redis came back empty: router/membership.py's seed list), and its
records in the index against the blocks it holds (`kvctl diff`, shared/index/block_digest.py).

Invariants: `GET /internal/registration` answers the NodeInfo the node registered (block_index_types.py's
JSON, its current epoch); `GET /internal/index-diff` answers IndexDiff.to_dict(), `POST` the same after
repairing (`{"repair": true}`); all answer 404 before the node registered (or without an index), 503 when
Redis fails the comparison, and, like every internal route but health and metrics, need the cluster's
credential (shared/node/node_auth.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pdserve.node.node_routes import message_response
from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.index.block_index_types import BlockIndexError


def add_announce_routes(app: FastAPI, rt: NodeRuntime) -> None:
    @app.get("/internal/registration")
    async def registration() -> Response:
        info = rt.registration
        if info is None:
            return JSONResponse({"error": f"node {rt.node_id} has not registered"}, status_code=404)
        return message_response(info)

    @app.get("/internal/index-diff")
    async def index_diff() -> JSONResponse:
        return await _diff(False)

    @app.post("/internal/index-diff")
    async def index_repair(request: Request) -> JSONResponse:
        body = await request.json() if await request.body() else {}
        return await _diff(bool(isinstance(body, dict) and body.get("repair")))

    async def _diff(repair: bool) -> JSONResponse:
        if rt.truth is None or rt.registration is None:
            return JSONResponse({"error": f"node {rt.node_id} is not in an index"}, status_code=404)
        try:
            diff = await rt.truth.diff(rt.epoch, repair)
        except BlockIndexError as exc:
            return JSONResponse({"error": f"node {rt.node_id}: {exc}"}, status_code=503)
        return JSONResponse(diff.to_dict())
