"""What a node tells about itself outside Redis: its registration, for a router that cannot find it in the
index (started while Redis is away, or Redis came back empty): router/membership.py's seed list.

Invariants: `/internal/registration` answers the NodeInfo the node registered (block_index_types.py's JSON,
its current epoch) and 404 before it registered; like every internal route but health and metrics it needs
the cluster's credential (shared/node_auth.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pdserve.shared.node_runtime import NodeRuntime


def add_announce_routes(app: FastAPI, rt: NodeRuntime) -> None:
    @app.get("/internal/registration")
    async def registration() -> Response:
        info = rt.registration
        if info is None:
            return JSONResponse({"error": f"node {rt.node_id} has not registered"}, status_code=404)
        return Response(info.to_json(), media_type="application/json")
