"""Every role's parts on one node process, whatever role it starts in, so that it can change role at run time
without a restart (node/role_change.py): P's prefill route and transfer sender, D's generate route and
transfer listener (its admission of P's KV), the prefix-fetch receiver and export route both roles use, and
the `/internal/role` route. The runtime's current role gates the prefill and generate routes; P's per-layer
observer is on the engine only while the node is a prefill node (an observer makes each step call back per
layer).

Costs of carrying both: the decode listener (and, on a P node, its port) is open on every node; the sender
connects only when P first sends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from fastapi import FastAPI
from pdserve.decode_node.server import DecodeHandler, add_decode_routes
from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.connector import KVSender, create_sender, create_server
from pdserve.node.kv_fetch import FetchReceiver, PrefixExporter, PrefixFetcher, add_export_route
from pdserve.node.node_cli import NodeConfigs
from pdserve.node.node_runtime import NodeRuntime
from pdserve.node.prefix_move import PrefixMoves, add_move_routes
from pdserve.node.role_change import RoleChanger, RoleParts, add_role_route
from pdserve.prefill_node.server import PrefillService, add_prefill_routes
from pdserve.shared.types import Role


async def setup(app: FastAPI, rt: NodeRuntime, cfg: NodeConfigs) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Adds every role's routes and transfer ends; returns (the start role's transfer address, teardown)."""
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, rt.engine.kv_layout)
    handler = DecodeHandler(rt, cfg.kv_load_failure_policy)
    server = create_server(cfg.connector, identity, handler)  # D's end: P pushes a prompt's KV here
    await server.start()
    # the receiving end of prefix fetches (P's, and D's for prompts it computes itself: local_fetch)
    receiver = FetchReceiver(rt)
    fetch_server = create_server(replace(cfg.connector, listen_port=0), identity, receiver)
    await fetch_server.start()
    fetcher = PrefixFetcher(rt, receiver, fetch_server.address, cfg.connector.auth_token)
    senders: list[KVSender] = []  # P's sender (a prompt's KV to D, and prefix exports), made on first use

    def sender() -> KVSender:
        if not senders:
            senders.append(create_sender(cfg.connector, identity))
        return senders[0]

    service = PrefillService(rt, sender, cfg.layers_per_frame, fetcher)
    service.attach()
    add_prefill_routes(app, service)
    add_decode_routes(app, rt, handler, fetcher)
    add_export_route(app, PrefixExporter(rt, sender, cfg.layers_per_frame))
    add_move_routes(app, PrefixMoves(rt, fetcher))  # a drain's prefixes move through the fetch path
    rt.requests_outside_engine = lambda: service.in_flight + len(handler.pending)
    rt.connector_kind = cfg.connector.kind
    decode_addr = cfg.transfer_advertise or server.address

    def transfer_addr(role: Role) -> str:
        return "" if role == "prefill" else decode_addr

    async def switch(role: Role) -> None:
        observer = service.observer if role == "prefill" else None
        engine = rt.engine

        def set_observer() -> None:
            engine.observer = observer

        await rt.aengine.call(set_observer)

    add_role_route(app, RoleChanger(rt, RoleParts(transfer_addr, switch)))
    if rt.role != "prefill":
        rt.engine.observer = None  # the engine loop has not started yet

    async def teardown() -> None:
        await server.stop()
        await fetch_server.stop()
        await fetcher.close()
        for s in senders:
            await s.close()

    return transfer_addr(rt.role), teardown
