"""`python -m pdserve.prefill_node`: a prefill node."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from pdserve.kvtransfer.common import KVLayout, PeerIdentity
from pdserve.kvtransfer.connector import ConnectorConfig, create_sender
from pdserve.kvtransfer.messages import PROTOCOL_VERSION
from pdserve.prefill_node.server import PrefillService, add_prefill_routes
from pdserve.shared.node_cli import node_parser
from pdserve.shared.node_runtime import NodeRuntime
from pdserve.shared.node_serve import serve


async def setup(
    app: FastAPI, rt: NodeRuntime, args: argparse.Namespace
) -> tuple[str, Callable[[], Awaitable[None]]]:
    cfg = ConnectorConfig(
        kind=args.connector,
        auth_token=args.auth_token or "",
        checksum=False if args.no_checksum else None,  # None: the connector's default (off on NVLink)
        device=args.device,
    )
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, KVLayout(**rt.kv_layout))  # type: ignore[arg-type]
    sender = create_sender(cfg, identity)
    service = PrefillService(rt, sender, args.layers_per_frame)
    service.attach()
    add_prefill_routes(app, service)
    rt.connector_kind = args.connector
    return "", sender.close


def main(argv: list[str] | None = None) -> int:
    p = node_parser("pdserve prefill")
    p.add_argument(
        "--layers-per-frame",
        type=int,
        default=4,
        help="consecutive layers of a prefill step sent as one KV-transfer frame (1: one per layer); "
        "4 measured best on two H200s (fewer NCCL kernels spinning beside the prefill's GEMMs)",
    )
    args = p.parse_args(argv)
    if not args.auth_token:
        p.error("--auth-token is required (the KV-transfer handshake's shared secret)")
    if args.layers_per_frame < 1:
        p.error(f"--layers-per-frame must be >= 1, got {args.layers_per_frame}")
    return serve(args, "prefill", setup, PROTOCOL_VERSION)


if __name__ == "__main__":
    sys.exit(main())
