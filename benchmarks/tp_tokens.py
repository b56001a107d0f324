"""Greedy tokens of a dummy-weight model through the engine at one tensor-parallel size, one JSON line per
request: a change to the TP path checks that its tokens equal main's by running this on each tree.

    python benchmarks/tp_tokens.py --tp 2 [--shape llama-3.1-8b] [--tokens 64]

Eight seeded random prompts of 16 to 1,000 tokens decode together (batch 8; the prefills as the scheduler
packs them), `--tokens` new tokens each, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json

import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.types import RequestId


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(NAMED_SHAPES))
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    cfg = EngineConfig(model=f"dummy:{args.shape}", device="cuda", dtype="bfloat16", max_num_seqs=8,
                       max_num_batched_tokens=8192, max_model_len=4096, tensor_parallel_size=args.tp,
                       gpu_memory_utilization=0.5)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    vocab = NAMED_SHAPES[args.shape].vocab_size
    lengths = [16, 40, 100, 250, 500, 700, 900, 1000]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    engine = LLMEngine(cfg)
    try:
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.new_request(RequestId(f"t{i}"), prompt, params))
        tokens: dict[str, list[int]] = {f"t{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[str(out.request_id)] += list(out.token_ids)
    finally:
        engine.close()
    for rid, ids in tokens.items():
        print(json.dumps({"request": rid, "token_ids": ids}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
