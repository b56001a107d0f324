"""The engine's command-line flags and the EngineConfig built from them, for every entry point that runs an
engine (`pdserve generate`, the node processes). Imports nothing heavy, so a bad flag fails fast."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.shared.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser, *, model_required: bool) -> None:
    p.add_argument(
        "--model",
        required=model_required,
        default=None,
        help="GGUF file, HF directory or dummy:<shape | config.json>",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    from pdserve.shared.config import EngineConfig

    return EngineConfig(
        model=model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
