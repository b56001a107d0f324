"""Time to first and second token, P/D across two devices beside one single node, straight to the node
processes (no router, no Redis), plus greedy output parity and the nodes' block audits.

A program, not a test: `python benchmarks/pd_ttft.py --model dummy:llama-3.1-8b --dtype bfloat16
--device-p cuda:0 --device-d cuda:1 --connector nccl` on a two-GPU machine (or `--device-p cpu --device-d cpu
--connector tcp --model dummy:smollm2-135m` to check it here). For each of N prompts it opens D's
`/internal/generate` stream and P's `/internal/prefill` at once, as the router does, and times the first
and second token lines from D; the single node gets the same prompts with `prefill_node_id` None. Prints
one table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx2
from pdserve.cli.redis_launch import free_port
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest, StepOutput
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import NodeId, RequestId


def add_node_options(ap: argparse.ArgumentParser, connector: str) -> None:
    """The options `node_argv` reads besides the pool's size (`kv_blocks`, `prompt_tokens`)."""
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--connector", default=connector)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="every node's KV cache (fp8: half of bf16's bytes per transfer)")  # fmt: skip
    ap.add_argument("--layers-per-frame", type=int, default=4, help="P's KV-transfer frame size in layers")


def node_argv(
    role: str, node_id: str, port: int, tport: int, device: str, args: argparse.Namespace, tp: int = 1
) -> list[str]:
    """A benchmark node's command line (prefix_reuse.py's too): the model, pool and connector of `args`,
    at tensor-parallel size `tp` over `device` (e.g. cuda:0,1)."""
    module = "pdserve.prefill_node" if role == "prefill" else "pdserve.decode_node"
    argv = [sys.executable, "-m", module, "--node-id", node_id, "--port", str(port), "--model", args.model,
            "--device", device, "--dtype", args.dtype, "--num-kv-blocks", str(args.kv_blocks),
            "--max-num-seqs", "8", "--max-model-len", str(args.prompt_tokens + 64),
            "--connector", args.connector, "--transfer-port", str(tport),
            "--kv-cache-dtype", args.kv_cache_dtype, "--log-level", "WARNING",
            "--tensor-parallel-size", str(tp)]  # fmt: skip
    if role == "prefill":
        argv += ["--layers-per-frame", str(args.layers_per_frame)]
    if role == "single":
        argv += ["--role", "single"]
    return argv


def start_node(
    role: str, node_id: str, device: str, args: argparse.Namespace, token: str, tp: int = 1
) -> tuple[subprocess.Popen[bytes], str, int]:
    port, tport = free_port(), free_port()
    env = os.environ | {"PDSERVE_AUTH_TOKEN": token}  # a secret: never on argv
    return subprocess.Popen(node_argv(role, node_id, port, tport, device, args, tp), env=env), \
        f"http://127.0.0.1:{port}", tport  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node at {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(f"{url}/internal/health", timeout=1).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"node at {url} not ready in {timeout_s}s")


async def drive(
    client: httpx2.AsyncClient,
    d_url: str,
    gen: NodeGenerateRequest,
    prefill: tuple[str, PrefillRequest] | None,
    on_step: Callable[[StepOutput], None],
) -> dict[str, Any]:
    """One request straight to the nodes, as the router sends it (prefix_reuse.py's too): P's
    `/internal/prefill` (prefill = (P url, request), or None) beside D's `/internal/generate` stream, each
    step line to `on_step` until the finish; returns P's result ({} without P)."""
    pre_task = None
    if prefill is not None:
        url, pre = prefill
        pre_task = asyncio.create_task(client.post(f"{url}/internal/prefill", content=pre.to_json()))
    async with client.stream("POST", f"{d_url}/internal/generate", content=gen.to_json()) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line:
                continue
            step = StepOutput.from_line(line)
            assert step.error is None, step.error
            on_step(step)
            if step.finish_reason is not None:
                break
    if pre_task is None:
        return {}
    result: dict[str, Any] = json.loads((await pre_task).content)
    assert result.get("error") is None, result
    return result


TOP_N = 5  # logprobs asked for: the sampled token's and the 5 most likely, per position
Position = tuple[int, dict[int, float]]  # sampled token id, token id -> logprob (sampled + top N)


def logprob_gap(a: list[list[Position]], b: list[list[Position]]) -> float:
    """Largest |logprob difference| over every position's tokens present in both; inf if any sampled
    token differs."""
    worst = 0.0
    for out_a, out_b in zip(a, b, strict=True):
        for (tok_a, lp_a), (tok_b, lp_b) in zip(out_a, out_b, strict=True):
            if tok_a != tok_b:
                return float("inf")
            worst = max([worst] + [abs(v - lp_b[k]) for k, v in lp_a.items() if k in lp_b])
    return worst


async def one(client: httpx2.AsyncClient, d_url: str, p: tuple[str, str] | None, rid: str, prompt: list[int],
              max_tokens: int) -> tuple[float, float, list[Position], dict[str, Any]]:  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_N)
    deadline = time.time() + 120
    gen = NodeGenerateRequest(RequestId(rid), tuple(prompt), params, None, deadline,
                              None if p is None else NodeId("prefill-0"))  # fmt: skip
    t0 = time.perf_counter()
    marks: list[float] = []
    tokens: list[Position] = []

    def on_step(step: StepOutput) -> None:
        assert step.logprobs is not None
        for t, lp in zip(step.token_ids, step.logprobs, strict=True):
            marks.append(time.perf_counter() - t0)
            tokens.append((t, {x.token_id: x.logprob for x in lp.top} | {t: lp.logprob}))

    pre = None
    if p is not None:
        pre = (
            p[0],
            PrefillRequest(RequestId(rid), tuple(prompt), params, None, deadline, NodeId("decode-0"), p[1]),
        )
    result = await drive(client, d_url, gen, pre, on_step)
    return marks[0], marks[1], tokens, result


Measured = tuple[list[float], list[float], list[list[Position]], list[dict[str, Any]]]


async def measure(d_url: str, p: tuple[str, str] | None, prompts: list[list[int]], max_tokens: int, tag: str,
                  token: str) -> Measured:  # fmt: skip
    ttft, t2, outs, results = [], [], [], []
    async with httpx2.AsyncClient(timeout=300, auth=signed(token)) as client:
        await one(client, d_url, p, f"{tag}-warm", prompts[0][::-1], max_tokens)
        for i, prompt in enumerate(prompts):
            a, b, toks, result = await one(client, d_url, p, f"{tag}-{i}", prompt, max_tokens)
            ttft.append(a)
            t2.append(b)
            outs.append(toks)
            results.append(result)
    return ttft, t2, outs, results


def transfer_alone(
    d_url: str,
    p: tuple[str, str],
    prompts: list[list[int]],
    max_tokens: int,
    token: str,
    empty_d: bool = True,
) -> list[dict[str, Any]]:
    """`prompts` to P/D again, once P holds them: P computes only each prompt's last block, so the transfer
    is (almost) all that is left; returns P's results. With `empty_d`, D's prefix cache is emptied first, so
    the whole KV moves (D kept the prompts' blocks from the run before, and would take only the last one)."""
    if empty_d:
        evicted = httpx2.post(f"{d_url}/internal/evict", json={"all": True}, auth=signed(token), timeout=30)
        evicted.raise_for_status()
    return asyncio.run(measure(d_url, p, prompts, max_tokens, "pdc" if empty_d else "pdh", token))[3]


def kv_bytes_per_token_of(model: str, kv_cache_dtype: str, dtype: str) -> int:
    """KV bytes per token of a dummy shape (0 for a model this program cannot size)."""
    from pdserve.shared.model.model_config import NAMED_SHAPES

    c = NAMED_SHAPES.get(model.removeprefix("dummy:"))
    if c is None:
        return 0
    size = 1 if kv_cache_dtype == "fp8" else (4 if dtype == "float32" else 2)
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * size


def transfer_line(who: str, results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One row of the `--cached` report: P's transfer to D (first DATA frame to D's ACK) beside P's compute
    of the same step, which per-layer frames wait for, and the part after P's first token (medians)."""
    med = statistics.median
    blocks = med([r.get("transferred_blocks", 0) for r in results])
    kv_bytes = blocks * 16 * kv_bytes_per_token_of(args.model, args.kv_cache_dtype, args.dtype)
    transfer = med([r.get("transfer_seconds", 0.0) for r in results])
    compute = med([r.get("compute_seconds", 0.0) for r in results])
    tail = med([r.get("transfer_tail_seconds", 0.0) for r in results])
    return (f"{who}: {blocks:.0f} blocks ({kv_bytes / 2**20:.1f} MiB) in {transfer * 1e3:.2f} ms "
            f"({kv_bytes / max(transfer, 1e-9) / 2**30:.1f} GiB/s); P's compute {compute * 1e3:.2f} ms; "
            f"after P's first token {tail * 1e3:.2f} ms")  # fmt: skip


def audit(url: str, token: str) -> dict[str, int]:
    return dict(httpx2.get(f"{url}/internal/audit", auth=signed(token), timeout=10).json())


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_node_options(ap, connector="nccl")
    ap.add_argument("--device-p", default="cuda:0")
    ap.add_argument("--device-d", default="cuda:1")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--cached", action="store_true",
                    help="every prompt to P/D again, held by P now, into D holding it and into D emptied "
                         "first (the whole KV; one frame of every layer after P's forward: the transfer "
                         "alone)")  # fmt: skip
    ap.add_argument("--device-s", default=None, help="the single node's devices (default: --device-p)")
    ap.add_argument("--tp-p", type=int, default=1, help="P's tensor-parallel size")
    ap.add_argument("--tp-d", type=int, default=1, help="D's tensor-parallel size")
    ap.add_argument(
        "--tp-s", type=int, default=None, help="the single node's tensor-parallel size (default: D's)"
    )
    ap.add_argument("--no-single", action="store_true",
                    help="P/D alone, without the single-node peer (for the transfer figures)")  # fmt: skip
    args = ap.parse_args()
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    token = secrets.token_hex(16)
    tp_s = args.tp_d if args.tp_s is None else args.tp_s
    single: tuple[Measured, dict[str, int]] | None = None
    if not args.no_single:
        s_proc, s_url, _ = start_node("single", "single-0", args.device_s or args.device_p, args, token, tp_s)
        try:
            wait_ready(s_url, s_proc)
            single = (
                asyncio.run(measure(s_url, None, prompts, args.max_tokens, "s", token)),
                audit(s_url, token),
            )
        finally:
            stop([s_proc])
    p_proc, p_url, _ = start_node("prefill", "prefill-0", args.device_p, args, token, args.tp_p)
    d_proc, d_url, d_tport = start_node("decode", "decode-0", args.device_d, args, token, args.tp_d)
    try:
        wait_ready(p_url, p_proc)
        wait_ready(d_url, d_proc)
        d_addr = f"{args.connector}://127.0.0.1:{d_tport}"
        run = measure(d_url, (p_url, d_addr), prompts, args.max_tokens, "pd", token)
        pd_ttft, pd_t2, pd_out, pd_res = asyncio.run(run)
        if args.cached:  # D holding the prompts first (as the run above left it), then emptied
            held_res = transfer_alone(d_url, (p_url, d_addr), prompts, args.max_tokens, token, empty_d=False)
            cached_res = transfer_alone(d_url, (p_url, d_addr), prompts, args.max_tokens, token)
        time.sleep(0.5)
        p_audit, d_audit = audit(p_url, token), audit(d_url, token)
    finally:
        stop([p_proc, d_proc])
    med = statistics.median
    print(f"\n{args.requests} prompts of {args.prompt_tokens} tokens, {args.model} {args.dtype} "
          f"(KV {args.kv_cache_dtype}), "
          f"P {args.device_p} TP={args.tp_p} -> D {args.device_d} TP={args.tp_d} over {args.connector} "
          f"(single: {'none' if single is None else f'{args.device_s or args.device_p} TP={tp_s}'}), "
          f"{args.layers_per_frame} layer(s) per frame\n")  # fmt: skip
    transfer = [r.get("transfer_seconds", 0.0) for r in pd_res]
    tail = [r.get("transfer_tail_seconds", 0.0) for r in pd_res]
    blocks = med([r.get("transferred_blocks", 0) for r in pd_res])
    kv_bytes = blocks * 16 * kv_bytes_per_token_of(args.model, args.kv_cache_dtype, args.dtype)
    print(f"KV transfer P -> D per request, p50: {med(transfer) * 1e3:.2f} ms for {blocks:.0f} blocks "
          f"({kv_bytes / 2**20:.1f} MiB, {kv_bytes / max(med(transfer), 1e-9) / 2**30:.1f} GiB/s); "
          f"not hidden under P's compute (tail) p50 {med(tail) * 1e3:.2f} ms\n")  # fmt: skip
    if args.cached:
        hits = med([r.get("cached_tokens", 0) for r in cached_res])
        print(f"Again with the prompt held by P ({hits:.0f} cached tokens; P computes the last block, and "
              f"its {args.layers_per_frame}-layer frames go out as it computes), p50:")  # fmt: skip
        for who, res in (("D emptied first", cached_res), ("D holding the prompt already", held_res)):
            print("- " + transfer_line(who, res, args))
        print()
    print("| metric | P/D | single | P/D / single |\n|---|---:|---:|---:|")
    audits = [("P", p_audit), ("D", d_audit)]
    if single is None:
        print(f"| time to first token p50 (ms) | {med(pd_ttft) * 1e3:.1f} | | |")
        print(f"| time to second token p50 (ms) | {med(pd_t2) * 1e3:.1f} | | |")
    else:
        (s_ttft, s_t2, s_out, _), s_audit = single
        for name, pd, one_node in (("time to first token p50 (ms)", med(pd_ttft), med(s_ttft)),
                                   ("time to second token p50 (ms)", med(pd_t2), med(s_t2))):  # fmt: skip
            print(f"| {name} | {pd * 1e3:.1f} | {one_node * 1e3:.1f} | {pd / one_node:.3f} |")
        same = sum([t for t, _ in x] == [t for t, _ in y] for x, y in zip(pd_out, s_out, strict=True))
        print(f"| greedy outputs identical, P/D vs single | {same}/{len(prompts)} | | |")
        print(
            f"| max abs logprob difference, P/D vs single (sampled + top {TOP_N}, every position) | "
            f"{logprob_gap(pd_out, s_out):.3g} | | |"
        )
        audits.append(("single", s_audit))
    for who, au in audits:
        print(f"| {who} audit in_use/reserved/live | {au['in_use']}/{au['reserved']}/"
              f"{au['live_requests']} | | |")  # fmt: skip
    clean = all(au["in_use"] == au["reserved"] == au["live_requests"] == 0 for _, au in audits)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
