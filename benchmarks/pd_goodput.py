"""Goodput under latency SLOs: P/D (prefill and decode nodes) against colocated `single` replicas on the same
devices, each behind one router, over a sweep of Poisson request rates (the DistServe comparison).

A program, not a test. On two GPUs:

    python benchmarks/pd_goodput.py --model dummy:llama-3.1-8b --node-args "--dtype bfloat16 ..." \
        --pd "prefill:--device cuda:0 --connector cuda_ipc" "decode:--device cuda:1 --connector cuda_ipc" \
        --colocated "single:--device cuda:0" "single:--device cuda:1" --rates 2,4,6,8 --out DIR

Each setup runs in its own cluster (benchmarks/serve_bench.py: Redis, the nodes, one router; audits after).
It first serves a few requests one at a time (the unloaded reference), then each rate on its own prompts
(`pdserve bench --request-rate R --save-detailed`, R x --seconds-per-rate requests, at least --min-prompts).
The SLOs are fixed before any loaded run, from the colocated setup's unloaded reference: TTFT <= median
unloaded TTFT x --ttft-scale and TPOT <= median unloaded TPOT x --tpot-scale. DistServe's definitions: a
request is good when it meets both; goodput is good requests per second; SLO attainment is the share of good
requests. Prints the sweep, the P/D / colocated goodput ratio at the first rate where the colocated pair's
attainment falls below --attainment, the same ratio under other SLO scales, each setup's highest rate with
every rate up to it at that attainment (DistServe's goodput), and writes goodput.json and goodput.png.

`--shifting-mix` compares the planner instead: at each rate, phase A (--input-len prompts, --short-output-len
outputs) then phase B (--short-input-len prompts, --output-len outputs) on the --pd nodes with their roles
fixed, and the same on the --planned nodes (default: the --pd ones) with `pdserve plan --watch --apply`
beside them. The SLOs are given (--ttft-slo-ms, --tpot-slo-ms; the planner plans for the same ones). Prints
each phase's goodput per setup and the planned / fixed ratio of phase B, and writes shifting.json.

    python benchmarks/pd_goodput.py --shifting-mix --model dummy:llama-3.1-8b --node-args "..." \
        --pd "prefill:--device cuda:0" "decode:--device cuda:1" \
        --planned "prefill:--device cuda:0" "decode:--device cuda:0" "prefill:--device cuda:1" \
        "decode:--device cuda:1" --rates 4 --ttft-slo-ms 2000 --tpot-slo-ms 60 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

SETUPS = ("pd", "colocated")
HERE = os.path.dirname(os.path.abspath(__file__))


def run_setup(name: str, nodes: Sequence[str], args: argparse.Namespace) -> int:
    common = ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos"]
    common += ["--disable-tqdm", "--save-detailed", "--request-timeout", "300"]
    groups = ["--", *common, "--max-concurrency", "1", "--num-prompts", str(args.ref_prompts)]
    groups += ["--result-file", os.path.join(args.out, f"{name}-ref.json")]
    for rate in args.rates:
        n = max(args.min_prompts, round(rate * args.seconds_per_rate))
        groups += ["--", *common, "--request-rate", str(rate), "--num-prompts", str(n)]
        groups += ["--dataset-seed", str(round(rate * 1000)), "--result-file", result_path(args, name, rate)]
    argv = [sys.executable, os.path.join(HERE, "serve_bench.py"), "--model", args.model]
    argv += ["--node-args", args.node_args, *(f"--node={n}" for n in nodes), *groups]
    print(f"== {name}: {' '.join(nodes)}", flush=True)
    return subprocess.run(argv, check=False).returncode


def run_shifting(name: str, nodes: Sequence[str], planner: bool, args: argparse.Namespace) -> int:
    """Phase A then phase B at each rate, on one cluster (with the planner beside it when `planner`)."""
    groups: list[str] = []
    for rate in args.rates:
        n = max(args.min_prompts, round(rate * args.seconds_per_rate))
        for phase, (inp, out) in phases(args).items():
            groups += [
                "--",
                "--input-len",
                str(inp),
                "--output-len",
                str(out),
                "--ignore-eos",
                "--disable-tqdm",
            ]
            groups += ["--save-detailed", "--request-timeout", "300", "--request-rate", str(rate)]
            groups += ["--num-prompts", str(n), "--dataset-seed", str(round(rate * 1000) + len(phase))]
            groups += ["--result-file", result_path(args, f"{name}-{phase}", rate)]
    argv = [sys.executable, os.path.join(HERE, "serve_bench.py"), "--model", args.model]
    argv += ["--node-args", args.node_args, *(f"--node={n}" for n in nodes)]
    if planner:
        argv.append(
            f"--planner-args=--watch {args.planner_watch:g} --window {args.planner_watch * 3:g} --apply "
            f"--dwell {args.planner_watch * 2:g} --stabilize {args.planner_watch * 2:g} "
            f"--ttft-slo-ms {args.ttft_slo_ms:g} "
            f"--tpot-slo-ms {args.tpot_slo_ms:g}"
        )
    print(f"== {name}: {' '.join(nodes)}", flush=True)
    return subprocess.run([*argv, *groups], check=False).returncode


def phases(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """The two phases of the shifting mix: (prompt tokens, output tokens)."""
    return {"a": (args.input_len, args.short_output_len), "b": (args.short_input_len, args.output_len)}


def report_shifting(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    print(f"\nSLO: TTFT <= {args.ttft_slo_ms:g} ms, TPOT <= {args.tpot_slo_ms:g} ms")
    print("\n| rate (req/s) | phase | setup | failed | SLO attainment | goodput (req/s) |")
    print("|---:|---|---|---:|---:|---:|")
    for rate in args.rates:
        for phase in phases(args):
            row: dict[str, Any] = {"rate": rate, "phase": phase}
            for name in ("fixed", "planned"):
                reqs, run = requests_of(result_path(args, f"{name}-{phase}", rate))
                row[name] = judge(reqs, run, args.ttft_slo_ms, args.tpot_slo_ms) | {"failed": run["failed"]}
                s = row[name]
                cells = f"{s['failed']} | {s['attainment']:.0%} | {s['goodput']:.2f}"
                print(f"| {rate:g} | {phase} | {name} | {cells} |")
            fixed = row["fixed"]["goodput"]
            row["ratio"] = row["planned"]["goodput"] / fixed if fixed else float("inf")
            rows.append(row)
    for row in rows:
        if row["phase"] == "b":
            print(f"phase B at {row['rate']:g} req/s: planned / fixed goodput = {row['ratio']:.2f}x")
    out = {"slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "rows": rows}
    with open(os.path.join(args.out, "shifting.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return out


def result_path(args: argparse.Namespace, name: str, rate: float) -> str:
    return os.path.join(args.out, f"{name}-{rate:g}.json")


def requests_of(path: str) -> tuple[list[list[Any]], dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)["runs"][0]
    return run["requests"], run


def judge(
    reqs: Sequence[Sequence[Any]], run: dict[str, Any], ttft_ms: float, tpot_ms: float
) -> dict[str, Any]:
    good = sum(1 for ttft, tpot, _, _ in reqs if ttft <= ttft_ms and (tpot or 0.0) <= tpot_ms)
    total = run["num_prompts"]
    return {"attainment": good / total, "goodput": good / run["duration_s"], "good": good, "total": total}


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def report(args: argparse.Namespace) -> dict[str, Any]:
    ref, _ = requests_of(os.path.join(args.out, "colocated-ref.json"))
    ttft0 = statistics.median(r[0] for r in ref)
    tpot0 = statistics.median(r[1] for r in ref if r[1] is not None)
    slo = {"ttft_ms": ttft0 * args.ttft_scale, "tpot_ms": tpot0 * args.tpot_scale}
    rows: list[dict[str, Any]] = []
    for rate in args.rates:
        row: dict[str, Any] = {"rate": rate}
        for name in SETUPS:
            reqs, run = requests_of(result_path(args, name, rate))
            row[name] = judge(reqs, run, slo["ttft_ms"], slo["tpot_ms"]) | {
                "failed": run["failed"],
                "ttft_p50": run["ttft_ms"]["median"], "ttft_p90": run["ttft_ms"]["p90"],
                "tpot_p50": run["tpot_ms"]["median"], "tpot_p90": run["tpot_ms"]["p90"],
                "scale_grid": {
                    f"{ts:g}x/{ps:g}x": judge(reqs, run, ttft0 * ts, tpot0 * ps)
                    for ts in (2, 5, 10) for ps in (1.25, 1.5, 2, 3)
                },
            }  # fmt: skip
        rows.append(row)
    first = next((r for r in rows if r["colocated"]["attainment"] < args.attainment), None)
    print(f"\nunloaded colocated reference: TTFT p50 {ttft0:.1f} ms, TPOT p50 {tpot0:.2f} ms; SLO TTFT <= "
          f"{slo['ttft_ms']:.0f} ms ({args.ttft_scale:g}x), "
          f"TPOT <= {slo['tpot_ms']:.2f} ms ({args.tpot_scale:g}x)")  # fmt: skip
    print("\n| rate (req/s) | setup | failed | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | SLO attainment | "
          "goodput (req/s) |\n|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        for name in SETUPS:
            s = r[name]
            print(f"| {r['rate']:g} | {name} | {s['failed']} | {s['ttft_p50']:.0f} / {s['ttft_p90']:.0f} | "
                  f"{s['tpot_p50']:.2f} / {s['tpot_p90']:.2f} | {s['attainment']:.0%} | "
                  f"{s['goodput']:.2f} |")  # fmt: skip
    verdict: dict[str, Any] = {"first_colocated_miss_rate": None}
    if first is not None:
        pd, co = first["pd"]["goodput"], first["colocated"]["goodput"]
        ratio = pd / co if co else float("inf")
        verdict = {"first_colocated_miss_rate": first["rate"], "pd_goodput": pd, "colocated_goodput": co,
                   "ratio": ratio, "target_met": ratio >= 2.0}  # fmt: skip
        print(f"\ncolocated attainment first below {args.attainment:.0%} at {first['rate']:g} req/s: goodput "
              f"P/D {pd:.2f} vs colocated {co:.2f} req/s = {ratio:.2f}x (target >= 2x: "
              f"{'met' if ratio >= 2 else 'not met'})")  # fmt: skip
        print("same rate, other SLO scales (TTFT x / TPOT x: P/D / colocated goodput):")
        for key, pd_j in first["pd"]["scale_grid"].items():
            co_j = first["colocated"]["scale_grid"][key]
            print(f"  {key}: {pd_j['goodput']:.2f} / {co_j['goodput']:.2f}")
    else:
        print(f"\nthe colocated pair kept {args.attainment:.0%} attainment at every rate: raise --rates")
    # DistServe's per-setup goodput: the highest rate swept below which every rate kept the attainment
    sustained = {name: max([0.0] + [r["rate"] for i, r in enumerate(rows)
                                     if all(x[name]["attainment"] >= args.attainment for x in rows[: i + 1])])
                 for name in SETUPS}  # fmt: skip
    verdict["sustained_rate"] = sustained
    print(f"highest rate with every rate up to it at >= {args.attainment:.0%} attainment"
          f" (DistServe's goodput): "
          f"P/D {sustained['pd']:g} req/s, colocated {sustained['colocated']:g} req/s")  # fmt: skip
    out = {"slo": slo, "reference": {"ttft_ms": ttft0, "tpot_ms": tpot0}, "rows": rows, "verdict": verdict}
    with open(os.path.join(args.out, "goodput.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    plot(rows, slo, os.path.join(args.out, "goodput.png"))
    return out


def plot(rows: Sequence[dict[str, Any]], slo: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    panels = (("goodput", "goodput (req/s)", None), ("attainment", "SLO attainment", None),
              ("ttft_p90", "TTFT p90 (ms)", slo["ttft_ms"]),
              ("tpot_p90", "TPOT p90 (ms)", slo["tpot_ms"]))  # fmt: skip
    for ax, (key, title, line) in zip(axes, panels, strict=True):
        for name, style in (("pd", "o-"), ("colocated", "s--")):
            ax.plot(rates, [r[name][key] for r in rows], style, label=name)
        if line is not None:
            ax.axhline(line, color="gray", lw=0.8, ls=":", label="SLO")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("P/D vs colocated replicas: goodput under TTFT and TPOT SLOs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/pd_goodput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--node-args", default="", help="flags for every node")
    p.add_argument("--pd", nargs="+", required=True, help="node specs (ROLE:FLAGS) of the P/D setup")
    p.add_argument("--colocated", nargs="+", help="node specs of the colocated setup (not --shifting-mix)")
    p.add_argument("--shifting-mix", action="store_true", help="planner on the --planned nodes vs --pd fixed")
    p.add_argument("--planned", nargs="+", help="node specs the planner moves (default: the --pd ones)")
    p.add_argument("--short-input-len", type=int, default=64, help="phase B's prompt tokens")
    p.add_argument("--short-output-len", type=int, default=4, help="phase A's output tokens")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="the TTFT SLO (--shifting-mix)")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="the TPOT SLO (--shifting-mix)")
    p.add_argument("--planner-watch", type=float, default=5.0, help="seconds between the planner's rounds")
    p.add_argument("--rates", default="2,4,6,8", help="Poisson request rates, req/s, comma-separated")
    p.add_argument("--seconds-per-rate", type=float, default=20.0)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--ref-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ttft-scale", type=float, default=5.0, help="TTFT SLO over the unloaded TTFT")
    p.add_argument("--tpot-scale", type=float, default=1.5, help="TPOT SLO over the unloaded TPOT")
    p.add_argument("--attainment", type=float, default=0.9, help="'meets its SLO': this share of requests")
    p.add_argument("--out", default="goodput")
    p.add_argument("--report-only", action="store_true", help="read the result files in --out again")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    if args.shifting_mix:
        if not args.report_only:
            rc = run_shifting("fixed", args.pd, False, args) or rc
            rc = run_shifting("planned", args.planned or args.pd, True, args) or rc
        report_shifting(args)
        return rc
    if not args.colocated:
        p.error("--colocated is required (unless --shifting-mix)")
    if not args.report_only:
        for name, nodes in (("colocated", args.colocated), ("pd", args.pd)):
            rc = run_setup(name, nodes, args) or rc
    report(args)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
