"""What structured output costs: output tokens/s of the engine with a JSON schema against unconstrained, at
each --batch, on one engine (the grammar's masks and their application are the only difference).

A program, not a test: `python -m pdserve.benchmarks.structured [--batch 1 16] [--max-tokens 128] ...`
prints a markdown table. Both sides run the same prompts, greedy, EOS ignored, exactly --max-tokens tokens
per request (the schema asks for a long array, so the grammar never ends first); each figure is the median
of --repeats runs after one warm-up, and the two sides alternate so that both see the same load on a shared
machine.
On a GPU: `--device cuda --model dummy:llama-3.1-8b --batch 64` (random weights, byte-level vocabulary of the
config's size, bf16, async scheduling on by default there). Target (issue 35): constrained at most 10 % slower
at batch 16 and 64.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence

import torch
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import Constraint, SamplingParams
from pdserve.shared.types import RequestId

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "active"],
        "additionalProperties": False,
    },
}
PROMPT = "List the users of the system as a JSON array of objects with id, name, tags and active."


def run(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams, tag: str) -> float:
    """Output tokens/s from submission to the last token, over every prompt at once."""
    requests = [engine.new_request(RequestId(f"{tag}-{i}"), p, params) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(out.token_ids) for out in engine.step())
    elapsed = time.perf_counter() - started
    assert produced == params.max_tokens * len(prompts), f"{produced} tokens, not {params.max_tokens} each"
    assert engine.grammar_matchers() == 0 and engine.audit().in_use == 0
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF, HF directory or dummy:<shape> (default: SmolLM2)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU; default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    cfg = EngineConfig(model=model, device=args.device, max_num_seqs=max(args.batch), seed=0)
    engine = LLMEngine(cfg)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
        constraint=Constraint("json_schema", json.dumps(SCHEMA)),
    )  # fmt: skip
    t0 = time.perf_counter()
    engine.grammars.compile(constrained.constraint)  # type: ignore[arg-type]
    compile_s = time.perf_counter() - t0
    print(
        f"# structured output cost: {model} on {args.device}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, overlap {cfg.overlap}, {datetime.date.today()}, load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    print(f"# first compile (vocabulary + schema): {compile_s * 1e3:.0f} ms; --max-tokens {args.max_tokens}")
    print("| batch | unconstrained tok/s | JSON schema tok/s | constrained / plain |")
    print("|---|---|---|---|")
    for batch in args.batch:
        prompts = [prompt] * batch
        run(engine, prompts, plain, "warm-plain")
        run(engine, prompts, constrained, "warm-json")
        ours: dict[str, list[float]] = {"plain": [], "json": []}
        for r in range(args.repeats):
            sides = [("plain", plain), ("json", constrained)]
            for name, params in sides if r % 2 == 0 else sides[::-1]:
                ours[name].append(run(engine, prompts, params, f"{name}-{r}"))
        p, j = statistics.median(ours["plain"]), statistics.median(ours["json"])
        print(f"| {batch} | {p:.1f} | {j:.1f} | {j / p:.3f} |")
    engine.close()


if __name__ == "__main__":
    main()
