"""The engine on the CPU vs Hugging Face transformers `generate`, same GGUF, same prompts, same threads.

A program, not a test: `python benchmarks/engine_cpu.py [--threads 2] [--repeats 3] ...` prints a markdown
table. Both sides get the same token ids, greedy, EOS ignored (`ignore_eos` for us, `min_new_tokens` for
HF), --max-tokens new tokens per request; each figure is the median of --repeats runs, after one warm-up.
Prefill and decode are timed apart: prefill ends when the first new token exists (HF: its streamer's first
token callback; us: the engine step that samples it), decode is the rest.
- batch 1: one chat prompt; decode tokens/s (target >= 1.0x HF);
- concurrent: --concurrency prompts of mixed lengths submitted at once to one engine, vs HF generating
  the same prompts as one left-padded batch; output tokens/s end to end (target >= 1.5x HF);
- load: our `load_model` weight time vs HF `from_pretrained`, tokenizer load reported apart (target < 5 s).
`--prefill-sweep` instead times one prompt's prefill at each of --lengths tokens (random token ids, a new
prompt each run): ours is the engine step loop from `add_request` to the first token (max_tokens 1, one engine
per length, warmed up once, as `pdserve bench --backend engine` drives it), HF's the forward of the same ids
with `logits_to_keep=1` and the argmax (the same work: the next token of the whole prompt). The two sides
alternate, which goes first swapping each repeat; the table gives the best and the median of --repeats
(target: pdserve <= HF at every length).
Our engine gets a fresh pool for each run, so the prefix cache never serves a repeat. Runs alternate between
the two sides (ours, HF, ours, HF...) so that both see the same load on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel, load_model, load_tokenizer
from pdserve.shared.types import RequestId

QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea at night.",
    "Explain photosynthesis to a ten-year-old in a few sentences, with one everyday example.",
    "List five fruits.",
    "How do I reverse a list in Python? Show two ways and explain when each one is better.",
    "Hi!",
    "Give me three tips for sleeping better.",
    "Describe the water cycle, step by step, and say which step is driven by the sun.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Why do cats purr?",
    "Write an email asking my landlord to fix the heating, politely but firmly, in under 80 words.",
    "Name the planets of the solar system in order from the sun.",
    "What does HTTP stand for?",
    "Suggest a name for a bakery that sells only bread made from ancient grains.",
    "Compare trains and planes for a 500 km trip: time, cost, comfort and emissions.",
)


@dataclass(frozen=True)
class Timing:
    prefill_s: float  # from submission to the first new token of every sequence
    decode_s: float  # from there to the last token
    output_tokens: int
    batch: int

    @property
    def decode_tps(self) -> float:
        return (self.output_tokens - self.batch) / self.decode_s

    @property
    def output_tps(self) -> float:
        return self.output_tokens / (self.prefill_s + self.decode_s)


def median_timing(runs: Sequence[Timing]) -> Timing:
    """Medians taken field by field (each field over the same runs)."""
    return Timing(
        statistics.median(r.prefill_s for r in runs),
        statistics.median(r.decode_s for r in runs),
        runs[0].output_tokens,
        runs[0].batch,
    )


def run_ours(loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int, blocks: int) -> Timing:
    engine = LLMEngine(EngineConfig(model=loaded.source, num_kv_blocks=blocks), loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.new_request(RequestId(f"b{i}"), p, params) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    waiting_first = {r.request_id for r in requests}
    first_done = started
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.token_ids)
            if out.token_ids and out.request_id in waiting_first:
                waiting_first.discard(out.request_id)
                if not waiting_first:
                    first_done = time.perf_counter()
    ended = time.perf_counter()
    audit = engine.audit()
    assert audit.in_use == audit.reserved == 0, audit
    assert produced == max_tokens * len(prompts), produced
    return Timing(first_done - started, ended - first_done, produced, len(prompts))


class _FirstTokenClock:
    """A transformers streamer: put() is called with the prompt, then once per generated step."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        return None


def run_hf(model: Any, prompts: Sequence[list[int]], max_tokens: int, pad_id: int) -> Timing:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
    ended = time.perf_counter()
    produced = (out.shape[1] - width) * len(prompts)
    assert produced == max_tokens * len(prompts), out.shape
    return Timing(clock.first_token_at - started, ended - clock.first_token_at, produced, len(prompts))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


@dataclass(frozen=True)
class Side:
    """One column of the table (medians)."""

    batch1: Timing
    concurrent: Timing
    weights_s: float
    tokenizer_s: float


def load_hf(path: str) -> tuple[Any, float, float]:
    """transformers' model and tokenizer from the GGUF: (model, weights seconds, tokenizer seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    weights_s, model = timed(
        lambda: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    )
    tokenizer_s, _ = timed(lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name))
    return model.eval(), weights_s, tokenizer_s


def measure(path: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[Side, Side | None]:
    """Both sides, interleaved run by run so that both see the same load on a shared machine."""
    cpu = torch.device("cpu")
    ours_loads: list[LoadedModel] = []
    hf_load_s: list[tuple[float, float]] = []
    hf_model: Any = None
    for _ in range(args.repeats):
        ours_loads.append(load_model(path, device=cpu, dtype=torch.float32))
        if not args.skip_hf:
            del hf_model  # one HF model alive at a time
            hf_model, weights_s, tokenizer_s = load_hf(path)
            hf_load_s.append((weights_s, tokenizer_s))
    loaded = ours_loads[-1]
    torch.set_num_threads(args.threads)  # loaders may change it
    pad = 0 if hf_model is None else int(hf_model.generation_config.pad_token_id or 0)
    runs: dict[str, list[Timing]] = {"ours1": [], "oursn": [], "hf1": [], "hfn": []}
    run_ours(loaded, prompts[:2], 4, args.kv_blocks)  # warm-up
    if hf_model is not None:
        run_hf(hf_model, prompts[:2], 4, pad)
    for _ in range(args.repeats):
        runs["ours1"].append(run_ours(loaded, prompts[:1], args.max_tokens, args.kv_blocks))
        if hf_model is not None:
            runs["hf1"].append(run_hf(hf_model, prompts[:1], args.max_tokens, pad))
        runs["oursn"].append(run_ours(loaded, prompts, args.max_tokens, args.kv_blocks))
        if hf_model is not None:
            runs["hfn"].append(run_hf(hf_model, prompts, args.max_tokens, pad))
    ours = Side(
        median_timing(runs["ours1"]),
        median_timing(runs["oursn"]),
        statistics.median(m.weights_load_s for m in ours_loads),
        statistics.median(m.tokenizer_load_s for m in ours_loads),
    )
    if hf_model is None:
        return ours, None
    hf = Side(
        median_timing(runs["hf1"]),
        median_timing(runs["hfn"]),
        statistics.median(w for w, _ in hf_load_s),
        statistics.median(t for _, t in hf_load_s),
    )
    return ours, hf


def prefill_once_ours(engine: LLMEngine, ids: list[int], tag: str) -> float:
    """Seconds from add_request to the step that samples the first token of `ids`."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    request = engine.new_request(RequestId(tag), ids, params)
    started = time.perf_counter()
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def prefill_once_hf(model: Any, ids: list[int]) -> float:
    """Seconds of HF's forward over `ids` and the argmax of the last position's logits."""
    started = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax().item()
    return time.perf_counter() - started


def prefill_sweep(path: str, args: argparse.Namespace) -> list[str]:
    """Table rows: per length, best and median prefill seconds of both sides and HF / pdserve."""
    loaded = load_model(path, device=torch.device("cpu"), dtype=torch.float32)
    hf_model, _, _ = load_hf(path)
    torch.set_num_threads(args.threads)  # loaders may change it
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    rows = [
        "| prompt tokens | pdserve best (s) | HF best (s) | HF / pdserve, best | pdserve median (s) "
        "| HF median (s) | HF / pdserve, median |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.lengths:
        cfg = EngineConfig(model=loaded.source, num_kv_blocks=-(-n // 16) + 2, max_model_len=n + 1)
        engine = LLMEngine(cfg, loaded)
        ours: list[float] = []
        hf: list[float] = []
        for run in range(args.repeats + 1):  # run 0 warms both up and is not counted
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()  # a new prompt: no prefix hit
            got: dict[str, float] = {}
            for side in ("ours", "hf") if run % 2 == 0 else ("hf", "ours"):
                if side == "ours":
                    got[side] = prefill_once_ours(engine, ids, f"p{n}-{run}")
                else:
                    got[side] = prefill_once_hf(hf_model, ids)
            if run:
                ours.append(got["ours"])
                hf.append(got["hf"])
        audit = engine.audit()
        assert audit.in_use == audit.reserved == 0, audit
        b_ours, b_hf, m_ours, m_hf = min(ours), min(hf), statistics.median(ours), statistics.median(hf)
        rows.append(
            f"| {n} | {b_ours:.3f} | {b_hf:.3f} | {b_hf / b_ours:.2f}x | {m_ours:.3f} | {m_hf:.3f} "
            f"| {m_hf / m_ours:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


def table(ours: Side, hf: Side | None, n: int) -> list[str]:
    def row(measure: str, get: Callable[[Side], float], spec: str, higher: bool, target: str = "") -> str:
        mine = get(ours)
        if hf is None:
            return f"| {measure} | {mine:{spec}} | - | - | {target} |"
        peer = get(hf)
        ratio = f"{mine / peer:.2f}x" if higher else f"{peer / mine:.2f}x"
        return f"| {measure} | {mine:{spec}} | {peer:{spec}} | {ratio} | {target} |"

    return [
        "| measure | pdserve | HF transformers | pdserve speed-up (>1: faster) | target |",
        "|---|---:|---:|---:|---|",
        row("batch 1: prefill (s)", lambda s: s.batch1.prefill_s, ".3f", False),
        row("batch 1: decode tokens/s", lambda s: s.batch1.decode_tps, ".1f", True, ">= 1.0x HF"),
        row(f"{n} concurrent: prefill (s)", lambda s: s.concurrent.prefill_s, ".3f", False),
        row(f"{n} concurrent: decode tokens/s", lambda s: s.concurrent.decode_tps, ".1f", True),
        row(f"{n} concurrent: output tokens/s", lambda s: s.concurrent.output_tps, ".1f", True, ">= 1.5x HF"),
        row("weight load (s)", lambda s: s.weights_s, ".2f", False, "< 5 s"),
        row("tokenizer load (s)", lambda s: s.tokenizer_s, ".2f", False),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description="pdserve engine vs HF transformers generate on the CPU")
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, choices=range(2, len(QUESTIONS) + 1))
    ap.add_argument("--kv-blocks", type=int, default=256, help="our pool size (16-token blocks)")
    ap.add_argument("--skip-hf", action="store_true", help="only our engine (no peer column)")
    ap.add_argument(
        "--prefill-sweep", action="store_true", help="prefill time by prompt length, vs HF forward"
    )
    ap.add_argument(
        "--lengths",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[256, 512, 1024, 1650, 2048, 4096],
        help="prompt lengths of --prefill-sweep, comma-separated",
    )
    args = ap.parse_args()
    path = args.model or default_model_path()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if args.prefill_sweep:
        print(
            f"# engine_cpu --prefill-sweep: {os.path.basename(path)}, fp32, {args.threads} torch threads, "
            f"{args.repeats} runs per side and length after one warm-up, interleaved\n"
            f"{datetime.datetime.now().isoformat(timespec='seconds')} on {platform.node()} "
            f"({os.cpu_count()} CPUs), torch {torch.__version__}; 1-min load average {load_before[0]:.2f}\n",
            flush=True,
        )
        rows = prefill_sweep(path, args)
        print(f"\n1-min load average after: {os.getloadavg()[0]:.2f}\n")
        print("\n".join(rows))
        return
    tok = load_tokenizer(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = prompts[: args.concurrency]
    ours, hf = measure(path, prompts, args)
    load_after = os.getloadavg()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    print(
        f"# engine_cpu: {os.path.basename(path)}, fp32, {args.threads} torch threads, "
        f"{args.max_tokens} new tokens per request (EOS ignored), median of {args.repeats}\n"
        f"{now} on {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}; "
        f"1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
        f"prompts: batch 1 {len(prompts[0])} tokens; concurrent {min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens\n"
    )
    print("\n".join(table(ours, hf, args.concurrency)))


if __name__ == "__main__":
    main()
