"""`python -m pdserve.prefill_node` (= `pdserve prefill`): a prefill node."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from pdserve.kvtransfer.common import PeerIdentity
from pdserve.kvtransfer.connector import create_sender
from pdserve.prefill_node.server import PrefillService, add_prefill_routes
from pdserve.shared.node.node_cli import NodeConfigs
from pdserve.shared.node.node_runtime import NodeRuntime


async def setup(app: FastAPI, rt: NodeRuntime, cfg: NodeConfigs) -> tuple[str, Callable[[], Awaitable[None]]]:
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, rt.engine.kv_layout)
    sender = create_sender(cfg.connector, identity)
    service = PrefillService(rt, sender, cfg.layers_per_frame)
    service.attach()
    add_prefill_routes(app, service)
    rt.connector_kind = cfg.connector.kind
    return "", sender.close


def main(argv: list[str] | None = None) -> int:
    from pdserve.cli import main as cli_main

    return cli_main(["prefill", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
