"""`pdserve bench`: the serving benchmark client, in the conventions of `vllm bench serve`.

Sends a workload (bench_datasets) to any OpenAI-compatible server (completions or chat, streamed, with
`ignore_eos` as an extra body field) at one or more loads: Poisson arrivals at `--request-rate` (gamma
intervals with `--burstiness`), capped at `--max-concurrency` in flight. `--backend engine` runs the same
workload through pdserve's engine alone in this process; `--compare-engine` runs it after the served runs,
so served / engine is one ratio from one command; before it, each load runs once on the engine driven
offline in waves of max-concurrency prompts (no client at all), the independent check. Numbers and their
definitions: bench_report.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx2
import numpy as np
from pdserve.cli.bench_datasets import (
    BenchRequest,
    Lengths,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from pdserve.cli.bench_options import BenchOptions
from pdserve.cli.bench_report import RequestResult, parse_goodput, plot, ratio, summarize, table
from pdserve.shared.cli.settings import flag_name
from pdserve.shared.model.tokenizer import Tokenizer
from tqdm import tqdm

if TYPE_CHECKING:
    from pdserve.shared.engine.async_engine import AsyncEngine
    from pdserve.shared.engine.engine import LLMEngine

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


def command_line(opts: BenchOptions) -> str:
    """The command that repeats this run: each setting that differs from its default, as its flag (whether
    it came from a flag, the environment or a --config file)."""
    args: list[str] = []
    for name, field in BenchOptions.model_fields.items():
        value, flag = getattr(opts, name), flag_name(name, BenchOptions)
        if value == field.default:
            continue
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        else:
            args += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    return "pdserve bench " + shlex.join(args)


def loads(args: BenchOptions) -> list[dict[str, Any]]:
    """One {request_rate, burstiness, max_concurrency} per load; at most one of the two flags is a list."""
    rates = [r.strip() for r in str(args.request_rate).split(",")]
    concs = [int(c) for c in str(args.max_concurrency).split(",")] if args.max_concurrency else [None]
    if len(rates) > 1 and len(concs) > 1:
        raise ValueError("sweep one of --request-rate or --max-concurrency, not both")
    if any(c is not None and c < 1 for c in concs) or args.burstiness <= 0:
        raise ValueError(f"--max-concurrency {concs} must be >= 1 and --burstiness {args.burstiness} > 0")
    for r in rates:
        if r != "inf" and not float(r) > 0:
            raise ValueError(f"--request-rate {r!r}: a positive number of requests/s, or inf")
    return [
        {"request_rate": r if r == "inf" else float(r), "burstiness": args.burstiness, "max_concurrency": c}
        for r in rates
        for c in concs
    ]


def workload(args: BenchOptions, tokenizer: Tokenizer | None, seed: int) -> list[BenchRequest]:
    """The requests of one load; another seed gives other prompts (a JSONL file gives the same ones)."""
    lengths = Lengths(args.input_len, args.output_len, args.range_ratio)
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        return jsonl_requests(args.dataset_path, args.output_len, tokenizer, args.num_prompts)
    if args.dataset_name == "prefix":
        groups, turns = args.prefix_groups, args.prefix_turns
        return shared_prefix_requests(groups, turns, args.prefix_len, lengths, tokenizer, seed)
    return random_requests(args.num_prompts, lengths, tokenizer, seed)


async def run_load(
    send: Send, requests: Sequence[BenchRequest], load: dict[str, Any], seed: int, quiet: bool
) -> tuple[list[RequestResult], float]:
    """Sends every request at the load's arrival times; returns the results and the wall time in seconds."""
    rate = load["request_rate"]
    shape = load["burstiness"]
    gaps = [0.0] * len(requests)
    if rate != "inf":
        gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=len(requests)).tolist()
    limit = asyncio.Semaphore(load["max_concurrency"] or len(requests))
    bar = tqdm(total=len(requests), disable=quiet, desc=f"{load['max_concurrency'] or rate}")

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            result = await send(req)
        bar.update()
        return result

    started = time.perf_counter()
    tasks = []
    for req, gap in zip(requests, gaps, strict=True):
        tasks.append(asyncio.create_task(one(req)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    bar.close()
    return list(results), time.perf_counter() - started


class OpenAIClient:
    """Streams one request to an OpenAI-compatible server and times its chunks."""

    def __init__(self, args: BenchOptions, model: str, tokenizer: Tokenizer | None, conns: int) -> None:
        self.chat = args.backend == "openai-chat"
        path = args.endpoint or ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.url = args.base_url.rstrip("/") + path
        self.tokenizer = tokenizer
        self.body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        self.body |= {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
        limits = httpx2.Limits(max_connections=conns, max_keepalive_connections=conns)
        self.http = httpx2.AsyncClient(timeout=args.request_timeout, limits=limits)

    async def send(self, req: BenchRequest) -> RequestResult:
        body = dict(self.body, max_tokens=req.output_len)
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.text(self.tokenizer)}]
        else:
            body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        result = RequestResult(req.prompt_len)
        events = 0
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", self.url, json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    result.error = f"HTTP {reply.status_code}: {text[:200]}"
                    return result
                async for line in reply.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                        return result
                    if chunk.get("usage"):
                        result.output_len = int(chunk["usage"]["completion_tokens"])
                    choice = (chunk.get("choices") or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if events:
                            result.itl_s.append(now - last)
                        else:
                            result.ttft_s = now - start
                        events, last = events + 1, now
        except httpx2.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
            return result
        result.e2e_s = time.perf_counter() - start
        result.output_len = result.output_len or events
        return result


def prompt_ids(tok: Tokenizer, req: BenchRequest, chat: bool) -> list[int]:
    """The token ids the engine gets for a request: the chat template around its text, or its prompt."""
    if chat:
        return list(tok.apply_chat_template([{"role": "user", "content": req.text(tok)}]))
    return tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)


def offline_waves(
    engine: LLMEngine, requests: Sequence[BenchRequest], wave: int, args: BenchOptions
) -> dict[str, float]:
    """The engine driven with no client, as an offline `generate` over the same prompts in batches: `wave`
    requests added at once and stepped until every one has ended, then the next wave. Output tokens are
    counted from the engine's outputs over the wall time of all waves: the independent check of the
    engine-alone run (no event loop, no per-token hand-off to a client)."""
    from pdserve.shared.engine.sampling_params import SamplingParams
    from pdserve.shared.types import RequestId

    chat = args.backend == "openai-chat"
    params = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=args.ignore_eos)
    batches = [requests[i : i + wave] for i in range(0, len(requests), wave)]
    ids = [[prompt_ids(engine.tokenizer, r, chat) for r in batch] for batch in batches]
    engine.bind_thread()
    tokens = 0
    start = time.perf_counter()
    for b, (batch, batch_ids) in enumerate(zip(batches, ids, strict=True)):
        for i, (req, prompt) in enumerate(zip(batch, batch_ids, strict=True)):
            rid = RequestId(f"wave-{b}-{i}")
            engine.add_request(engine.new_request(rid, prompt, replace(params, max_tokens=req.output_len)))
        while engine.has_unfinished():
            tokens += sum(len(out.token_ids) for out in engine.step())
    wall = time.perf_counter() - start
    return {
        "waves": len(batches),
        "output_tokens": tokens,
        "duration_s": wall,
        "output_throughput": tokens / wall,
    }


class EngineClient:
    """Runs one request through pdserve's engine in this process (no HTTP), timed per step output."""

    def __init__(self, args: BenchOptions, aengine: AsyncEngine) -> None:
        from pdserve.shared.engine.sampling_params import SamplingParams

        self.chat = args.backend == "openai-chat"
        self.aengine = aengine
        self.params = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=args.ignore_eos)
        self.sent = 0

    async def send(self, req: BenchRequest) -> RequestResult:
        from pdserve.shared.types import RequestId

        engine = self.aengine.engine
        ids = prompt_ids(engine.tokenizer, req, self.chat)
        result = RequestResult(req.prompt_len)
        self.sent += 1
        start = last = time.perf_counter()
        try:
            params = replace(self.params, max_tokens=req.output_len)
            request = engine.new_request(RequestId(f"bench-{self.sent}"), ids, params)
        except ValueError as exc:
            result.error = str(exc)
            return result
        async for out in self.aengine.generate(request):
            if out.token_ids:
                now = time.perf_counter()
                if result.output_len:
                    result.itl_s.append(now - last)
                else:
                    result.ttft_s = now - start
                result.output_len, last = result.output_len + len(out.token_ids), now
            if out.finish_reason in ("abort", "error"):
                result.error = f"engine finished the request with {out.finish_reason!r}"
        result.e2e_s = time.perf_counter() - start
        return result


async def served_model(base_url: str) -> str:
    try:
        async with httpx2.AsyncClient(timeout=30) as http:
            reply = await http.get(base_url.rstrip("/") + "/v1/models")
            reply.raise_for_status()
            return str(reply.json()["data"][0]["id"])
    except (httpx2.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"cannot read the model from {base_url}/v1/models ({exc}); start a server (`pdserve up`), "
            "point --base-url at one, or pass --served-model-name"
        ) from exc


async def sweep(
    name: str, send: Send, workloads: list[list[BenchRequest]], args: BenchOptions
) -> list[dict[str, Any]]:
    """A warm-up request (the first of workloads[0]), then each load on its own workload (workloads[1:], so
    no load finds its prompts cached by an earlier one); each load's summary."""
    first = workloads[0][0]
    warm = await send(BenchRequest(first.prompt, first.prompt_len, min(4, first.output_len)))
    if warm.error:
        raise ValueError(f"the warm-up request failed: {warm.error}")
    slos = parse_goodput(args.goodput)
    runs = []
    for load, requests in zip(loads(args), workloads[1:], strict=True):
        results, wall = await run_load(send, requests, load, args.dataset_seed, args.disable_tqdm)
        runs.append(summarize(name, load, results, wall, slos, args.save_detailed))
    return runs


def _model(args: BenchOptions) -> str:
    if args.model:
        return args.model
    from pdserve.shared.cli.default_model import default_model_path

    return default_model_path()


async def _engine_runs(args: BenchOptions, workloads: list[list[BenchRequest]]) -> list[dict[str, Any]]:
    from pdserve.shared.cli.engine_args import engine_config
    from pdserve.shared.engine.async_engine import AsyncEngine
    from pdserve.shared.engine.engine import LLMEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = engine_config(args.model_copy(update={"model": _model(args)}))
    engine = LLMEngine(cfg)
    waves = []
    if args.backend != "engine":  # before the loop owns the engine (its stop closes it)
        first = workloads[0][0]  # the warm-up request sweep() sends too
        warm = BenchRequest(first.prompt, first.prompt_len, min(4, first.output_len))
        offline_waves(engine, [warm], 1, args)
        for load, requests in zip(loads(args), workloads[1:], strict=True):
            waves.append(offline_waves(engine, requests, load["max_concurrency"] or len(requests), args))
            engine.evict(None)  # no later run finds these prompts cached
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        runs = await sweep("engine", EngineClient(args, aengine).send, workloads, args)
    finally:
        await aengine.stop()
    for run, wave in zip(runs, waves, strict=False):  # no waves with --backend engine
        run["offline_waves"] = wave
    return runs


async def bench(args: BenchOptions) -> dict[str, Any]:
    from pdserve.shared.model.loader import load_tokenizer

    tokenizer = None if args.random_text else load_tokenizer(_model(args), args.tokenizer)
    workloads = [workload(args, tokenizer, args.dataset_seed + i) for i in range(len(loads(args)) + 1)]
    size = len(workloads[1])
    served: list[dict[str, Any]] = []
    if args.backend != "engine":
        model = args.served_model_name or await served_model(args.base_url)
        conns = max(c or size for c in (load["max_concurrency"] for load in loads(args)))
        client = OpenAIClient(args, model, tokenizer, conns)
        try:
            served = await sweep(args.backend, client.send, workloads, args)
        finally:
            await client.http.aclose()
    engine = await _engine_runs(args, workloads) if args.backend == "engine" or args.compare_engine else []
    runs, engine_runs = (served, engine) if served else (engine, [])
    return {
        "label": args.label or args.backend,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command_line(args),
        "model": args.served_model_name or _model(args),
        "dataset": {k: getattr(args, k) for k in ("dataset_name", "num_prompts", "input_len", "output_len")}
        | {"range_ratio": args.range_ratio, "requests": size},
        "runs": runs,
        "engine_runs": engine_runs,
        "served_over_engine": [ratio(s, e) for s, e in zip(runs, engine_runs, strict=True)]
        if engine_runs
        else [],
    }


def main(args: BenchOptions) -> int:
    """`pdserve bench` with its validated settings."""
    from pdserve.shared.model.loader import ModelLoadError

    try:
        result = asyncio.run(bench(args))
    except (ValueError, OSError, ModelLoadError) as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 1
    engine_runs = result["engine_runs"] or [None] * len(result["runs"])
    for run, engine in zip(result["runs"], engine_runs, strict=True):
        print(table(run, engine))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, allow_nan=False)
    if args.plot:
        plot(result["label"], result["runs"], result["engine_runs"], args.plot)
    return 0
