"""`python -m pdserve.prefill_node` (= `pdserve prefill`): a prefill node."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.connector import create_sender, create_server
from pdserve.node.kv_fetch import FetchReceiver, PrefixExporter, PrefixFetcher, add_export_route
from pdserve.node.node_cli import NodeConfigs
from pdserve.node.node_runtime import NodeRuntime
from pdserve.node.prefix_move import PrefixMoves, add_move_routes
from pdserve.prefill_node.server import PrefillService, add_prefill_routes


async def setup(app: FastAPI, rt: NodeRuntime, cfg: NodeConfigs) -> tuple[str, Callable[[], Awaitable[None]]]:
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, rt.engine.kv_layout)
    sender = create_sender(cfg.connector, identity)
    # the receiving end of prefix fetches: holders push the blocks this node lacks into it
    receiver = FetchReceiver(rt)
    server = create_server(cfg.connector, identity, receiver)
    await server.start()
    fetcher = PrefixFetcher(rt, receiver, server.address, cfg.connector.auth_token)
    service = PrefillService(rt, sender, cfg.layers_per_frame, fetcher)
    service.attach()
    add_prefill_routes(app, service)
    add_export_route(app, PrefixExporter(rt, lambda: sender, cfg.layers_per_frame))
    add_move_routes(app, PrefixMoves(rt, fetcher))  # a drain's prefixes move through the fetch path
    rt.connector_kind = cfg.connector.kind

    async def teardown() -> None:
        await sender.close()
        await server.stop()
        await fetcher.close()

    return "", teardown


def main(argv: list[str] | None = None) -> int:
    from pdserve.cli.main import main as cli_main

    return cli_main(["prefill", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
