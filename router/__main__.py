"""`python -m pdserve.router --model PATH --redis URL [--host H --port P ...]`: one router process.

The only place a RouterConfig is built from argv. The router loads the model's tokenizer only (never
weights), learns nodes, block size and fingerprint from the Redis index, and serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import uvicorn
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.policy import PolicyConfig
from pdserve.shared.block_index import BlockIndex
from pdserve.shared.block_index_types import RedisConfig
from pdserve.shared.loader import load_tokenizer


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    ap = argparse.ArgumentParser(prog="python -m pdserve.router", description=__doc__)
    ap.add_argument("--model", required=True, help="model file or directory (its tokenizer is loaded)")
    ap.add_argument("--served-model-name", help="the `model` id clients use (default: the model's file name)")
    ap.add_argument("--redis", required=True, help="redis://, rediss:// or unix:// URL of the block index")
    ap.add_argument("--redis-cluster", default="default", help="the cluster name of the index's keys")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--deadline", type=float, default=600.0, help="default request deadline, seconds")
    ap.add_argument("--max-deadline", type=float, default=3600.0, help="cap on `timeout`, seconds")
    ap.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024)
    ap.add_argument("--max-n", type=int, default=16, help="cap on n x prompts of one request")
    ap.add_argument("--node-list-ttl", type=float, default=1.0, help="node list reuse, seconds")
    ap.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="prefill on the decode node when it would compute at most this many tokens",
    )
    ap.add_argument("--api-key", action="append", default=[], help="accepted bearer key (repeatable)")
    args = ap.parse_args(argv)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return RouterConfig(
        model_path=args.model,
        served_model_name=name,
        redis=RedisConfig(url=args.redis, cluster=args.redis_cluster),
        host=args.host,
        port=args.port,
        default_deadline_s=args.deadline,
        max_deadline_s=args.max_deadline,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        node_list_ttl_s=args.node_list_ttl,
        policy=PolicyConfig(local_prefill_max_tokens=args.local_prefill_max_tokens),
        api_keys=tuple(args.api_key),
    )


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = parse_args(argv)
        tokenizer = load_tokenizer(config.model_path)
    except (ValueError, OSError) as exc:
        sys.exit(f"pdserve.router: {exc}")
    app = create_app(config, tokenizer, BlockIndex(config.redis))
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
