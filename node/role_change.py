"""A node changing role at run time (`kvctl role NODE prefill|decode|single`): the route that starts it and
the one change under way.

Every node process carries every role's parts (cli/node_roles.py): P's prefill route and transfer sender,
D's generate route and transfer listener, one engine. The runtime's current role (`NodeRuntime.role`) gates
the routes, so a change swaps no server object: the node stops taking new work (its index record shows it
draining at once, its routes answer 503 so routers place the request elsewhere), finishes what it holds
(decodes run to the end; with `migrate` each running decode that can move ends with the migration signal, as
in `kvctl drain --migrate`, and the router continues it on another node from the tokens already streamed,
fetching their KV from this node), switches the role's engine hook (P's per-layer
observer), then registers under the new role with a new epoch and resends its held blocks under it: the
prefix cache stays, in the engine and in the index.

Invariants: at most one change at a time, and none on a draining node (drain wins: undrain first); a change
ends exactly once, registered under the new role, or (if the index refused the registration) back in the
old one taking work again; a node that leaves cancels its change first (`NodeRuntime.until_leave`), so
no registration follows its deregistration. The caller's reply comes when the change started, and `kvctl
role` waits for the index to show the new registration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.index.block_index_types import BlockIndexError
from pdserve.shared.node.node_protocol import RoleChangeRequest
from pdserve.shared.types import Role
from pdserve.shared.wire import WireError

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
"""How often a change looks whether the node's last request of its old role has ended."""


@dataclass(frozen=True)
class RoleParts:
    """What differs between roles on one node process, given by cli/node_roles.py."""

    transfer_addr: Callable[[Role], str]
    """The KV-transfer address the registration announces in a role ("" for prefill: nobody sends to P)."""
    switch: Callable[[Role], Awaitable[None]]
    """Sets the engine up for a role (P's per-layer observer on or off); called while the node is idle."""


class RoleChanger:
    def __init__(self, rt: NodeRuntime, parts: RoleParts) -> None:
        self.rt = rt
        self.parts = parts
        self._task: asyncio.Task[None] | None = None

    def start(self, msg: RoleChangeRequest) -> tuple[int, dict[str, object]]:
        """Starts the change; (HTTP status, reply body)."""
        rt = self.rt
        if rt.draining:
            return 409, {"error": f"node {rt.node_id} is draining: undrain it before changing its role"}
        if self._task is not None and not self._task.done():
            return 409, {"error": f"node {rt.node_id} is already changing role"}
        reply: dict[str, object] = {"ok": True, "node_id": rt.node_id, "from_role": rt.role, "role": msg.role}
        if msg.role == rt.role:
            return 200, reply | {"changed": False, "epoch": rt.epoch}
        rt.changing_role = True
        self._task = rt.until_leave(self._change(msg))
        return 202, reply | {"changed": True, "epoch": rt.epoch}

    async def _change(self, msg: RoleChangeRequest) -> None:
        rt, old = self.rt, self.rt.role
        log.info(
            "node %s: changing role %s -> %s%s",
            rt.node_id,
            old,
            msg.role,
            " (migrating)" if msg.migrate else "",
        )
        try:
            await rt.beat_now()  # routers see it draining within this heartbeat and stop choosing it
            while True:
                if (
                    msg.migrate
                ):  # as `kvctl drain --migrate`: the requests move with their KV (node/drain_migrate.py)
                    await rt.mover.migrate_running()
                load = await rt.aengine.call(rt.load)
                if load.running == 0 and load.waiting == 0 and rt.requests_outside_engine() == 0:
                    break
                await asyncio.sleep(IDLE_POLL_S)
            await self.parts.switch(msg.role)
            rt.changing_role = False
            await rt.register_as(msg.role, self.parts.transfer_addr(msg.role))
        except BlockIndexError as exc:
            log.error("node %s: role change to %s failed in the index (%s); serving as %s", rt.node_id,
                      msg.role, exc, rt.role)  # fmt: skip
            await self.parts.switch(rt.role)
        finally:
            if rt.changing_role:  # cancelled (the node stops) or failed before the switch
                rt.changing_role = False
                await self.parts.switch(rt.role)


def add_role_route(app: FastAPI, changer: RoleChanger) -> None:
    """`POST /internal/role` ({"role", "migrate"}): behind the cluster's credential like every internal
    route but health and metrics (shared/node/node_auth.py)."""

    @app.post("/internal/role")
    async def role(request: Request) -> JSONResponse:
        try:
            msg = RoleChangeRequest.from_json(await request.body())
        except (WireError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        status, body = changer.start(msg)
        return JSONResponse(body, status_code=status)
