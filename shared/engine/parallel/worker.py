"""A worker rank's process (ranks 1..N-1 of a tensor-parallel engine): `python -m
pdserve.shared.engine.parallel.worker '<json>'`, started by rank 0 (ranks.py) with its arguments as JSON.

It loads its share of the model, sets its "loaded" key, joins the group, agrees on the KV pool's size, then
runs every step rank 0 broadcasts (the same forward, its heads, no sampling: a greedy step's argmax is
reduced across ranks, so every rank holds its tokens) until the channel closes.
Invariants: it never schedules, allocates blocks or samples (rank 0 does); it runs exactly the steps rank 0
runs, in the same order, so their collectives pair up; any failure ends the process with one log line and a
non-zero exit, and the end of the channel (rank 0 closed it or died) ends it with 0. It ends through
`os._exit`: the interpreter's teardown of a gloo group whose peer is gone can hang.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.parallel.dist import COLLECTIVE_TIMEOUT_S, DistCollectives
from pdserve.shared.engine.parallel.kv_pools import map_shared_pool, publish_cuda_pool
from pdserve.shared.engine.parallel.ranks import loaded_key
from pdserve.shared.engine.parallel.step_channel import StepReader

log = logging.getLogger("pdserve.tp.worker")


def serve(args: dict[str, Any]) -> None:
    from datetime import timedelta

    from pdserve.shared.engine.model_runner import ModelRunner, kv_pool_shape, size_kv_pool
    from pdserve.shared.model.loader import load_model

    cfg = EngineConfig(**args["config"])
    rank = int(args["rank"])
    torch.set_num_threads(int(args["threads"]))
    reader = StepReader(int(args["region_fd"]), int(args["bell_fd"]), int(args["capacity"]), rank - 1,
                        cfg.tensor_parallel_size - 1)  # fmt: skip
    device = cfg.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the memory plan and Triton's launches use the current device
    comm = DistCollectives(rank, cfg.tensor_parallel_size, device, dtype=cfg.torch_dtype)
    loaded = load_model(cfg.model, device=device, dtype=cfg.torch_dtype, tokenizer_path=cfg.tokenizer,
                        seed=cfg.seed, comm=comm, progress=False, quantization=cfg.quantization)  # fmt: skip
    store = dist.TCPStore(
        "127.0.0.1", int(args["store_port"]), is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    store.set(loaded_key(rank), "1")
    comm.join(store)
    mc = loaded.config
    max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    num_blocks = comm.agree_min(cfg.num_kv_blocks or size_kv_pool(cfg, loaded, max_model_len))
    shape = kv_pool_shape(loaded, cfg, num_blocks)
    if device.type == "cpu":  # rank 0 maps the same pages (kv_pools.py)
        kv = map_shared_pool(int(args["kv_fd"]), shape, cfg.torch_kv_dtype)
        os.close(int(args["kv_fd"]))
    else:
        kv = torch.zeros(shape, dtype=cfg.torch_kv_dtype, device=device)
        publish_cuda_pool(store, rank, kv)
    runner = ModelRunner(loaded, cfg, num_blocks, max_model_len=max_model_len, device=device, kv_cache=kv)
    prev: torch.Tensor | None = None  # async scheduling: the last sampling step's tokens, from rank 0
    while (step := reader.receive()) is not None:
        out = runner.execute(step.items, prev_tokens=prev, wait=not cfg.overlap, argmax=step.argmax)
        sampled = sum(it.sample for it in step.items)
        if cfg.overlap and step.argmax:  # its tokens are this rank's already (an all-gather)
            prev = out
        elif cfg.overlap and sampled:
            prev = comm.broadcast_tokens(torch.empty(sampled, dtype=torch.int64, device=device))


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s tp-worker %(levelname)s %(name)s: %(message)s"
    )
    try:
        serve(json.loads(argv[0]))
    except Exception as exc:  # one line; rank 0's watchdog takes the engine down
        log.error("tensor-parallel worker (pid %d) failed: %s", os.getpid(), " ".join(str(exc).split())[:500])
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
