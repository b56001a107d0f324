"""Command-line flags every node process takes, and turning them into configs. Only entry points call this."""

from __future__ import annotations

import argparse
import logging

from pdserve.shared.block_index_types import RedisConfig
from pdserve.shared.config import EngineConfig
from pdserve.shared.engine_args import add_engine_args, engine_config
from pdserve.shared.node_runtime import NodeSettings


def node_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--node-id", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--redis", default=None, help="redis://[:password@]host:port/db of the block index")
    p.add_argument("--redis-password", default=None)
    p.add_argument("--cluster", default="default")
    p.add_argument("--transfer-port", type=int, default=0)
    p.add_argument("--connector", default="tcp", help="KV connector kind: tcp, ucx, nccl or cuda_ipc")
    p.add_argument("--auth-token", default=None, help="shared secret of the KV-transfer handshake")
    p.add_argument("--no-checksum", action="store_true", help="skip frame checksums (NVLink/RDMA links)")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--log-level", default="INFO")
    add_engine_args(p, model_required=True)
    return p


def configs(args: argparse.Namespace, role: str) -> tuple[EngineConfig, NodeSettings]:
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s {args.node_id} %(levelname)s %(name)s: %(message)s"
    )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = engine_config(args, args.model)
    redis = None
    if args.redis:
        redis = RedisConfig(url=args.redis, password=args.redis_password, cluster=args.cluster)
    settings = NodeSettings(
        node_id=args.node_id,
        role=role,
        host=args.host,
        port=args.port,
        redis=redis,
        heartbeat_s=args.heartbeat_s,
    )
    return engine, settings
