"""`python -m pdserve.decode_node` (= `pdserve decode`; with --role single, `pdserve single`): a decode node
or a plain non-disaggregated node."""

from __future__ import annotations

import sys
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


async def setup(app: FastAPI, rt: NodeRuntime, cfg: NodeConfigs) -> tuple[str, Callable[[], Awaitable[None]]]:
    handler = DecodeHandler(rt, cfg.kv_load_failure_policy)
    identity = PeerIdentity(rt.node_id, rt.engine.fingerprint, rt.engine.kv_layout)
    server = create_server(cfg.connector, identity, handler)
    await server.start()
    # the receiving end of prefix fetches for prompts this node computes itself (the cost model's local_fetch)
    fetch_receiver = FetchReceiver(rt)
    fetch_server = create_server(replace(cfg.connector, listen_port=0), identity, fetch_receiver)
    await fetch_server.start()
    fetcher = PrefixFetcher(rt, fetch_receiver, fetch_server.address, cfg.connector.auth_token)
    add_decode_routes(app, rt, handler, fetcher)
    rt.connector_kind = cfg.connector.kind
    senders: list[KVSender] = []  # the sender of prefix exports, made when a prefill node first fetches

    def sender() -> KVSender:
        if not senders:
            senders.append(create_sender(cfg.connector, identity))
        return senders[0]

    add_export_route(app, PrefixExporter(rt, sender, cfg.layers_per_frame))
    add_move_routes(app, PrefixMoves(rt, fetcher))  # a drain's prefixes move through the fetch path

    async def teardown() -> None:
        await server.stop()
        await fetch_server.stop()
        await fetcher.close()
        for s in senders:
            await s.close()

    return cfg.transfer_advertise or server.address, teardown


def main(argv: list[str] | None = None) -> int:
    """`--role single` (what `pdserve up` passes to single nodes) picks the `single` command."""
    from pdserve.cli.main import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    command = "decode"
    if "--role" in args:
        i = args.index("--role")
        command = args[i + 1] if i + 1 < len(args) else "decode"
        del args[i : i + 2]
    if command not in ("decode", "single"):
        print(f"pdserve decode: error: --role {command!r}: accepted decode, single", file=sys.stderr)
        return 2
    return cli_main([command, *args])


if __name__ == "__main__":
    sys.exit(main())
