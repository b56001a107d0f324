"""`python -m pdserve.decode_node`: a decode node (or, with --role single, a plain non-disaggregated node)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from pdserve.decode_node.server import DecodeHandler, add_decode_routes
from pdserve.kvtransfer.common import KVLayout, PeerIdentity
from pdserve.kvtransfer.connector import ConnectorConfig, create_server
from pdserve.kvtransfer.messages import PROTOCOL_VERSION
from pdserve.shared.node_cli import node_parser
from pdserve.shared.node_runtime import NodeRuntime
from pdserve.shared.node_serve import serve


async def setup(
    app: FastAPI, rt: NodeRuntime, args: argparse.Namespace
) -> tuple[str, Callable[[], Awaitable[None]]]:
    handler = DecodeHandler(rt)
    add_decode_routes(app, rt, handler)
    cfg = ConnectorConfig(
        kind=args.connector,
        auth_token=args.auth_token or "",
        checksum=False if args.no_checksum else None,  # None: the connector's default (off on NVLink)
        device=args.device,
        listen_host=args.host,
        listen_port=args.transfer_port,
    )
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, KVLayout(**rt.kv_layout))  # type: ignore[arg-type]
    server = create_server(cfg, identity, handler)
    await server.start()
    rt.connector_kind = args.connector
    return server.address, server.stop


def main(argv: list[str] | None = None) -> int:
    p = node_parser("pdserve decode | single")
    p.add_argument("--role", default="decode", choices=["decode", "single"])
    args = p.parse_args(argv)
    if not args.auth_token:
        p.error("--auth-token is required (the KV-transfer handshake's shared secret)")
    return serve(args, args.role, setup, PROTOCOL_VERSION)


if __name__ == "__main__":
    sys.exit(main())
