"""Cross-node prefix reuse and the host-memory tier (issue 21), measured against recomputing, in one run.

A program, not a test: `python benchmarks/prefix_reuse.py --device cuda:0 --connector cuda_ipc` on one GPU
(two prefill nodes and a decode node share it; `--device cpu --connector tcp --model dummy:smollm2-135m
--prefix-tokens 512` to check it here). Straight to the node processes, as the router sends them (no
router, no Redis). Phases, each a median over `--runs`:
1. cold: the prompt (prefix + suffix) prefilled on P1 with every node's cache emptied first;
2. fetched: the same prompt placed on P2 while only P1 holds the prefix: P2 fetches it from P1 over the
   connector and computes the suffix (D and P2 emptied first); greedy tokens must equal the cold run's;
3. short prompts: P/D against prefill on D itself, by prompt length (the crossover);
4. host tier (one engine in this process, nodes stopped): a prefix evicted from the device pool into the
   host tier by a second prompt comes back from it, against the same prompts computed cold.
Prints one table; with --json-out, writes the figures there too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import statistics
import sys
import time
from typing import Any

import httpx2
import torch
from pdserve.benchmarks.pd_ttft import add_node_options, drive, node_argv, start_node, stop, wait_ready
from pdserve.cli.up import Cluster, free_port, start_redis
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.model_runner import kv_bytes_per_block
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest, StepOutput
from pdserve.shared.node.node_sign import ClusterKeys, signed
from pdserve.shared.types import BlockHash, NodeId, RequestId

BS = 16


async def request(
    client: httpx2.AsyncClient,
    d_url: str,
    prefill: tuple[str, str, str] | None,
    prompt: list[int],
    fetch: tuple[str, int] | None = None,
) -> tuple[float, list[int], dict[str, Any]]:
    """(time to first token, greedy tokens, P's result) of one request; prefill = (P id, P url, D addr), or
    None: D computes the prompt (after fetching `fetch` = (holder url, blocks) when given)."""
    rid = RequestId(f"r{secrets.token_hex(6)}")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    deadline = time.time() + 300
    local_fetch = (None, 0) if prefill is not None or fetch is None else fetch
    gen = NodeGenerateRequest(
        rid,
        tuple(prompt),
        params,
        None,
        deadline,
        None if prefill is None else NodeId(prefill[0]),
        *local_fetch,
    )
    t0 = time.perf_counter()
    first = 0.0
    tokens: list[int] = []

    def on_step(step: StepOutput) -> None:
        nonlocal first
        if step.token_ids and not tokens:
            first = time.perf_counter() - t0
        tokens.extend(step.token_ids)

    pre = None
    if prefill is not None:
        url, blocks = fetch if fetch is not None else (None, 0)
        pre = (prefill[1], PrefillRequest(rid, tuple(prompt), params, None, deadline, NodeId("decode-0"),
                                          prefill[2], url, blocks))  # fmt: skip
    result = await drive(client, d_url, gen, pre, on_step)
    return first, tokens, result


async def evict(client: httpx2.AsyncClient, *urls: str) -> None:
    for url in urls:
        (await client.post(f"{url}/internal/evict", json={"all": True})).raise_for_status()


PHASES = ("fetch_seconds", "compute_seconds", "transfer_seconds")


async def nodes_phase(
    args: argparse.Namespace, urls: dict[str, str], d_addr: str, token: str
) -> dict[str, Any]:
    rng = random.Random(0)
    prefix = [rng.randrange(1, 30000) for _ in range(args.prefix_tokens)]
    prompt = prefix + [rng.randrange(1, 30000) for _ in range(16)]
    p1 = ("prefill-0", urls["prefill-0"], d_addr)
    p2 = ("prefill-1", urls["prefill-1"], d_addr)
    d = urls["decode-0"]
    out: dict[str, Any] = {}
    async with httpx2.AsyncClient(timeout=600, auth=signed(token)) as client:
        await request(client, d, p1, [t + 1 for t in prompt[:512]])  # warm-up (kernels, connections)
        await request(client, d, p2, [t + 2 for t in prompt[:512]], (urls["prefill-0"], 512 // BS))
        cold, fetched, fetched_blocks = [], [], []
        phases: dict[str, list[float]] = {}  # P's own account of each run: fetch, compute, transfer
        want: list[int] = []
        for _ in range(args.runs):
            await evict(client, *urls.values())
            t, toks, res = await request(client, d, p1, prompt)
            for k in PHASES:
                phases.setdefault(f"cold_{k}", []).append(res[k])
            cold.append(t)
            want = want or toks
            assert toks == want, "cold runs disagree"
        for _ in range(args.runs):  # P1 holds the prefix from the cold runs
            await evict(client, urls["prefill-1"], d)
            t, toks, res = await request(client, d, p2, prompt, (urls["prefill-0"], len(prefix) // BS))
            assert toks == want, "a fetched prefix gave other tokens than the cold run"
            fetched.append(t)
            fetched_blocks.append(res["fetched_tokens"] // BS)
            for k in PHASES:
                phases.setdefault(f"fetched_{k}", []).append(res[k])
        out["cold_ttft_s"], out["fetched_ttft_s"] = cold, fetched
        out["phases"] = phases
        out["fetched_blocks"] = fetched_blocks
        short: dict[int, dict[str, float]] = {}
        for n in args.short_lengths:
            pd, local = [], []
            for _ in range(args.runs):
                p = [rng.randrange(1, 30000) for _ in range(n)]
                pd.append((await request(client, d, p1, p))[0])
                local.append((await request(client, d, None, [t + 3 for t in p]))[0])
            short[n] = {"pd_s": statistics.median(pd), "local_s": statistics.median(local)}
        out["short"] = short
    return out


def decisions(metrics: str, series: str = "decisions_total") -> dict[str, float]:
    """The router's cost-model decision counters (or another of its per-option series), by option."""
    pattern = rf'pdserve_router_cost_model_{series}\{{option="(\w+)"\}} ([0-9.e+-]+)'
    return {m[0]: float(m[1]) for m in re.findall(pattern, metrics)}


async def routed(
    client: httpx2.AsyncClient, base: str, model: str, prompt: list[int]
) -> tuple[float, float, str, str, float]:
    """(time to the first streamed token, time to the first non-empty text, greedy text of 4 tokens, the
    cost model's option, its estimate of the choice's time to first token) of one request through the
    router. The first token's text may be held back (the detokenizer releases no incomplete UTF-8: with the
    byte-level tokenizer of dummy weights, any token >= 0x80), so the chunks carry logprobs (logprobs=0),
    which arrive with their token, text or not: the first token's time is then what the nodes' own
    first-token time measures, straight to the nodes."""
    before_page = (await client.get(f"{base}/metrics")).text
    before = decisions(before_page)
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    t0 = time.perf_counter()
    first, first_text, text = 0.0, 0.0, ""
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = choice.get("text", "")
            if not first and (piece or (choice.get("logprobs") or {}).get("tokens")):
                first = time.perf_counter() - t0
            if piece and not first_text:
                first_text = time.perf_counter() - t0
            text += piece
    after_page = (await client.get(f"{base}/metrics")).text
    after = decisions(after_page)
    option = ",".join(k for k in after if after[k] > before.get(k, 0.0)) or "?"
    sums = [
        decisions(page, "estimated_ttft_seconds_sum").get(option, 0.0) for page in (before_page, after_page)
    ]
    return first, first_text, text, option, sums[1] - sums[0]


async def wait_index(index: BlockIndex, hashes: list[BlockHash], want: dict[str, int]) -> None:
    """Until the index shows `want` prefix blocks per node (at least; exactly for 0)."""
    deadline = time.monotonic() + 30
    while True:
        got = await index.lookup(hashes)
        if all(got.get(NodeId(n), 0) >= b if b else got.get(NodeId(n), 0) == 0 for n, b in want.items()):
            return
        assert time.monotonic() < deadline, f"index {got}, waited for {want}"
        await asyncio.sleep(0.05)


async def router_phase(
    args: argparse.Namespace, cluster: Cluster, redis_url: str, base: str
) -> dict[str, Any]:
    """Through the router (cost model on): the prompt cold (every cache emptied) against the same prompt
    while only prefill-0 holds its prefix (seeded by a P/D request of another suffix, then evicted from the
    other nodes); the router picks the placement (its option is recorded). Beside it, straight to the nodes:
    prefill-1 fetching from prefill-0 (pd_fetch) and the decode node fetching from prefill-0 (local_fetch)."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, 30000) for _ in range(args.prefix_tokens)]
    prompt = prefix + [rng.randrange(1, 30000) for _ in range(16)]
    seed = prefix + [rng.randrange(1, 30000) for _ in range(16)]
    urls = {n: cluster.urls[n] for n in ("prefill-0", "prefill-1", "decode-0")}
    token = cluster.auth_token
    index = BlockIndex(RedisConfig(url=redis_url), ClusterKeys(token))
    out: dict[str, Any] = {"cold": [], "held": [], "held_option": [], "cold_option": [], "cold_text": [],
                           "held_text": [], "held_estimate": []}  # fmt: skip
    try:
        while len(await index.nodes()) < 3:
            await asyncio.sleep(0.2)
        info = (await index.nodes())[0].info
        hashes = hash_blocks(prompt, BS, hash_seed(bytes.fromhex(info.model_fingerprint), None))
        full = args.prefix_tokens // BS
        d_addr = next(s.info.transfer_addr for s in await index.nodes() if s.info.node_id == "decode-0")
        p1 = ("prefill-0", urls["prefill-0"], d_addr)
        p2 = ("prefill-1", urls["prefill-1"], d_addr)
        async with httpx2.AsyncClient(timeout=600, auth=signed(token)) as client:
            model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
            for warm in range(3):  # kernels, connections, and the cost model's first observations
                await routed(client, base, model, [t + warm + 1 for t in prompt[:2048]])
            want = ""
            for _ in range(args.runs):
                await evict(client, *urls.values())
                await wait_index(index, hashes[:full], dict.fromkeys(urls, 0))
                t, t_text, text, option, _ = await routed(client, base, model, prompt)
                out["cold"].append(t)
                out["cold_text"].append(t_text)
                out["cold_option"].append(option)
                want = want or text
                assert text == want, "cold runs through the router disagree"
                await evict(client, *urls.values())
                await request(client, urls["decode-0"], p1, seed)  # prefill-0 (and D) now hold the prefix
                await evict(client, urls["prefill-1"], urls["decode-0"])
                await wait_index(index, hashes[:full], {"prefill-0": full, "prefill-1": 0, "decode-0": 0})
                t, t_text, text, option, estimate = await routed(client, base, model, prompt)
                out["held_estimate"].append(estimate)
                assert text == want, "a prefix held on another node gave other text than the cold run"
                out["held"].append(t)
                out["held_text"].append(t_text)
                out["held_option"].append(option)
            straight: dict[str, list[float]] = {"pd_fetch": [], "local_fetch": []}
            for _ in range(args.runs):
                await evict(client, urls["prefill-1"], urls["decode-0"])
                t, _, res = await request(client, urls["decode-0"], p2, prompt, (urls["prefill-0"], full))
                assert res["fetched_tokens"] >= (full - 1) * BS, res
                straight["pd_fetch"].append(t)
                await evict(client, urls["prefill-1"], urls["decode-0"])
                t, _, _ = await request(client, urls["decode-0"], None, prompt, (urls["prefill-0"], full))
                straight["local_fetch"].append(t)
            out["straight"] = straight
    finally:
        await index.close()
    return out


def run_router(args: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster()
    try:
        redis_url = start_redis(cluster)
        for role, name in (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0")):
            port = free_port()
            argv = [*node_argv(role, name, port, free_port(), args.device, args), "--redis", redis_url]
            cluster.spawn(name, argv, env=cluster.secret_env, url=f"http://127.0.0.1:{port}")
        for name in ("prefill-0", "prefill-1", "decode-0"):
            cluster.wait_http(f"{cluster.urls[name]}/internal/health", timeout_s=600)
        port = free_port()
        router = [sys.executable, "-m", "pdserve.router", "--model", args.model, "--redis", redis_url,
                  "--port", str(port), "--cost-model", "--log-level", "WARNING"]  # fmt: skip
        cluster.spawn("router", router, env=cluster.secret_env)
        base = f"http://127.0.0.1:{port}"
        cluster.wait_http(f"{base}/health", timeout_s=120)
        return asyncio.run(router_phase(args, cluster, redis_url, base))
    finally:
        cluster.stop()


def host_tier_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Two engines on one set of weights, each with a pool that holds one prefix: without a tier a prefix is
    recomputed (the baseline); with one, alternating two prefixes evicts each into the host tier and brings
    it back (its time includes copying out the prefix it evicts)."""
    blocks = args.prefix_tokens // BS + 64
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_kv_blocks=blocks,
                       max_model_len=args.prefix_tokens + 64, cuda_graphs=False)  # fmt: skip
    plain = LLMEngine(cfg)
    per_block = kv_bytes_per_block(plain.loaded, cfg)
    tiered = LLMEngine(
        EngineConfig(**{**cfg.__dict__, "host_kv_cache_bytes": 3 * blocks * per_block}), plain.loaded
    )
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(engine: LLMEngine, prompt: list[int]) -> float:
        req = engine.new_request(RequestId(f"h{secrets.token_hex(4)}"), prompt, params)
        t0 = time.perf_counter()
        engine.add_request(req)
        while engine.has_unfinished():
            if any(o.token_ids for o in engine.step()):
                break
        if engine.cfg.torch_device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return first

    def fresh() -> list[int]:
        return [rng.randrange(1, 30000) for _ in range(args.prefix_tokens)]

    a, b = fresh(), fresh()
    for engine in (plain, tiered):
        ttft(engine, fresh()[:512])  # warm-up
    recomputed = [ttft(plain, a if i % 2 == 0 else b) for i in range(args.runs)]  # each evicts the other
    ttft(tiered, a)
    ttft(tiered, b)  # a is in the host tier now
    assert tiered.tier is not None
    before = tiered.tier.restored
    restored = [ttft(tiered, a if i % 2 == 0 else b) for i in range(args.runs)]
    return {"cold_s": recomputed, "restored_s": restored, "restored_blocks": tiered.tier.restored - before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_node_options(ap, connector="cuda_ipc")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prefix-tokens", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--short-lengths", type=int, nargs="*", default=[16, 64, 256, 1024, 4096])
    ap.add_argument("--json-out", default="")
    ap.add_argument("--skip-host-tier", action="store_true")
    ap.add_argument("--router", action="store_true", help="through a router (cost model on) and Redis")
    args = ap.parse_args()
    args.kv_blocks = args.prefix_tokens // BS + 256
    args.prompt_tokens = args.prefix_tokens + 64
    med = statistics.median
    if args.router:
        r = run_router(args)
        c, h = med(r["cold"]), med(r["held"])
        print(f"\n{args.model} {args.dtype} on {args.device}, {args.connector}, through the router "
              f"(cost model on), prefix {args.prefix_tokens} + 16, median of {args.runs}\n")  # fmt: skip
        print("| measure | value | against | ratio |\n|---|---:|---:|---:|")
        print(f"| TTFT, prefix held on prefill-0 only, through the router (ms) | {h * 1e3:.1f} | cold "
              f"{c * 1e3:.1f} | {c / h:.1f}x |")  # fmt: skip
        ct, ht = med(r["cold_text"]), med(r["held_text"])
        print(f"| time to the first non-empty text, held (ms) | {ht * 1e3:.1f} | cold {ct * 1e3:.1f} | "
              f"{ct / ht:.1f}x |")  # fmt: skip
        options = f"cold {sorted(set(r['cold_option']))}, held {sorted(set(r['held_option']))}"
        print(f"| router's options: {options} | | | |")
        print(f"| the cost model's estimate of the held prompt's choice (ms, from the choice's start) | "
              f"{med(r['held_estimate']) * 1e3:.1f} | | |")  # fmt: skip
        for k, v in r["straight"].items():
            print(f"| straight to the nodes, {k} from prefill-0 (ms) | {med(v) * 1e3:.1f} | cold (router) "
                  f"{c * 1e3:.1f} | {c / med(v):.1f}x |")  # fmt: skip
        print(json.dumps({k: [round(x * 1e3, 1) if isinstance(x, float) else x for x in v]
                          for k, v in r.items() if isinstance(v, list)}))  # fmt: skip
        if args.json_out:
            with open(args.json_out, "w") as fh:
                json.dump({"router": r, "args": vars(args)}, fh)
        return 0
    token = secrets.token_hex(16)
    procs, urls, tports = [], {}, {}
    try:
        for role, name in (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0")):
            proc, url, tport = start_node(role, name, args.device, args, token)
            procs.append(proc)
            urls[name], tports[name] = url, tport
        for proc, url in zip(procs, urls.values(), strict=True):
            wait_ready(url, proc, timeout_s=400)
        nodes = asyncio.run(
            nodes_phase(args, urls, f"{args.connector}://127.0.0.1:{tports['decode-0']}", token)
        )
    finally:
        stop(procs)
    print(f"\n{args.model} {args.dtype} on {args.device}, {args.connector}, prefix {args.prefix_tokens} "
          f"tokens + 16, median of {args.runs}\n")  # fmt: skip
    print("| measure | value | against | ratio |\n|---|---:|---:|---:|")
    c, f = med(nodes["cold_ttft_s"]), med(nodes["fetched_ttft_s"])
    print(f"| TTFT, prefix fetched from another node (ms) | {f * 1e3:.1f} | cold {c * 1e3:.1f} | "
          f"{c / f:.1f}x |")  # fmt: skip
    for case in ("cold", "fetched"):
        parts = ", ".join(
            f"{k.split('_')[0]} {med(nodes['phases'][f'{case}_{k}']) * 1e3:.1f}" for k in PHASES
        )
        print(f"| P's account of a {case} request (ms, medians): {parts} | | | |")
    fetched = med(nodes["fetched_blocks"])
    print(f"| blocks fetched per request | {fetched:.0f} | {args.prefix_tokens // BS} | |")
    for n, row in nodes["short"].items():
        print(f"| TTFT {n} tokens: on D / P/D (ms) | {row['local_s'] * 1e3:.1f} | {row['pd_s'] * 1e3:.1f} | "
              f"{row['local_s'] / row['pd_s']:.2f} |")  # fmt: skip
    crossover = max((n for n, r in nodes["short"].items() if r["local_s"] <= r["pd_s"]), default=0)
    print(f"\nshort-prompt crossover: prefill on D is no slower up to {crossover} tokens", flush=True)
    result: dict[str, Any] = {"nodes": nodes, "crossover": crossover, "args": vars(args)}
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh)
    if not args.skip_host_tier:
        host = host_tier_phase(args)
        hc, hr = med(host["cold_s"]), med(host["restored_s"])
        print(f"| TTFT, prefix back from the host tier (ms) | {hr * 1e3:.1f} | recomputed {hc * 1e3:.1f} | "
              f"{hc / hr:.1f}x | ({host['restored_blocks']} blocks restored)")  # fmt: skip
        if args.json_out:
            with open(args.json_out, "w") as fh:
                json.dump(result | {"host": host}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
