"""`pdserve bench`'s numbers: per-request timings in, the summary, the printed table, the result file's
schema and the plot out.

Definitions follow `vllm bench serve`: TTFT is send to first token; TPOT is (E2E - TTFT) / (output tokens
- 1) over requests with more than one token; ITL is the gap between successive streamed chunks, over all
chunks of all requests; E2E is send to the last byte. Throughputs divide by the run's wall time (first
send to last completion). Goodput counts completed requests within every SLO given, per second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
STATS = ("mean", "median", "p90", "p99")
_LATENCIES = {"ttft_ms": "Time to first token", "tpot_ms": "Time per output token (excl. 1st)",
              "itl_ms": "Inter-token latency", "e2el_ms": "End-to-end latency"}  # fmt: skip
_STAT_SCHEMA = {
    "type": "object",
    "required": list(STATS),
    "properties": {k: {"type": "number"} for k in STATS},
}
RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "backend",
        "load",
        "num_prompts",
        "completed",
        "failed",
        "errors",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        *_LATENCIES,
        "input_lens",
        "output_lens",
    ],
    "properties": {
        "backend": {"type": "string"},
        "load": {
            "type": "object",
            "required": ["request_rate", "burstiness", "max_concurrency"],
            "properties": {
                "request_rate": {"type": ["number", "string"]},
                "burstiness": {"type": "number"},
                "max_concurrency": {"type": ["integer", "null"]},
            },
        },
        "num_prompts": {"type": "integer", "minimum": 1},
        "completed": {"type": "integer", "minimum": 0},
        "failed": {"type": "integer", "minimum": 0},
        "errors": {"type": "array", "items": {"type": "string"}},
        "request_goodput": {"type": ["number", "null"]},
        **{k: {"type": "number", "minimum": 0} for k in ("duration_s", "request_throughput")},
        **{k: {"type": "number", "minimum": 0} for k in ("output_throughput", "total_token_throughput")},
        **{k: _STAT_SCHEMA for k in _LATENCIES},
        "input_lens": {"type": "array", "items": {"type": "integer"}},
        "output_lens": {"type": "array", "items": {"type": "integer"}},
    },
}
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["label", "date", "command", "model", "dataset", "runs", "engine_runs", "served_over_engine"],
    "properties": {
        "runs": {"type": "array", "minItems": 1, "items": RUN_SCHEMA},
        "engine_runs": {"type": "array", "items": RUN_SCHEMA},
        "served_over_engine": {"type": "array", "items": {"type": ["number", "null"]}},
    },
}


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds from its send."""

    prompt_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.output_len > 0

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput {item!r}: write KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        slos[key] = float(value)
    return slos


def _stats(values_s: Sequence[float]) -> dict[str, float]:
    if not values_s:
        return dict.fromkeys(STATS, 0.0)
    ms = np.asarray(values_s) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99))}  # fmt: skip


def summarize(
    backend: str,
    load: Mapping[str, Any],
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: Mapping[str, float],
    detailed: bool = False,
) -> dict[str, Any]:
    """The run's summary; `detailed` adds `requests`: [ttft_ms, tpot_ms or None, e2el_ms, output tokens] of
    every completed request, so goodput can be read again under other SLOs."""
    done = [r for r in results if r.ok]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)

    def good(r: RequestResult) -> bool:
        got = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2e_s}
        return all(got[k] * 1e3 <= v for k, v in slos_ms.items())

    wall = max(duration_s, 1e-9)
    extra: dict[str, Any] = {}
    if detailed:
        extra["requests"] = [
            [r.ttft_s * 1e3, None if r.tpot_s is None else r.tpot_s * 1e3, r.e2e_s * 1e3, r.output_len]
            for r in done
        ]
    return extra | {
        "backend": backend,
        "load": dict(load),
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / wall,
        "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "request_goodput": sum(map(good, done)) / wall if slos_ms else None,
        "ttft_ms": _stats([r.ttft_s for r in done]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in done for g in r.itl_s]),
        "e2el_ms": _stats([r.e2e_s for r in done]),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
    }


def load_label(load: Mapping[str, Any]) -> str:
    parts = [f"concurrency {load['max_concurrency']}"] if load["max_concurrency"] else []
    parts += [] if load["request_rate"] == "inf" else [f"rate {load['request_rate']}/s"]
    return " ".join(parts) or "all at once"


def table(run: Mapping[str, Any], engine: Mapping[str, Any] | None) -> str:
    """The run's summary as text, in the layout of `vllm bench serve`."""
    rows = [
        f"{' Serving Benchmark Result (' + run['backend'] + ', ' + load_label(run['load']) + ') ':=^60}",
        f"{'Successful requests:':<44}{run['completed']:>16}",
        f"{'Failed requests:':<44}{run['failed']:>16}",
        f"{'Benchmark duration (s):':<44}{run['duration_s']:>16.2f}",
        f"{'Total input tokens:':<44}{run['total_input_tokens']:>16}",
        f"{'Total generated tokens:':<44}{run['total_output_tokens']:>16}",
        f"{'Request throughput (req/s):':<44}{run['request_throughput']:>16.2f}",
        f"{'Output token throughput (tok/s):':<44}{run['output_throughput']:>16.2f}",
        f"{'Total token throughput (tok/s):':<44}{run['total_token_throughput']:>16.2f}",
    ]
    if run["request_goodput"] is not None:
        rows.append(f"{'Request goodput (req/s):':<44}{run['request_goodput']:>16.2f}")
    if engine is not None:
        rows.append(f"{'Engine alone output throughput (tok/s):':<44}{engine['output_throughput']:>16.2f}")
        rows.append(f"{'Served / engine (output tok/s):':<44}{ratio(run, engine) or 0.0:>16.1%}")
        if "offline_waves" in engine:
            waves = engine["offline_waves"]
            rows.append(f"{'Offline engine in waves (tok/s):':<44}{waves['output_throughput']:>16.2f}")
            rows.append(f"{'Served / offline waves (output tok/s):':<44}{ratio(run, waves) or 0.0:>16.1%}")
    for key, title in _LATENCIES.items():
        name = key.split("_")[0].upper()
        rows.append(f"{' ' + title + ' ':-^60}")
        rows += [f"{f'{s.capitalize()} {name} (ms):':<44}{run[key][s]:>16.2f}" for s in STATS]
    rows += [f"{'':=^60}", *(f"error: {e}" for e in run["errors"])]
    return "\n".join(rows)


def ratio(run: Mapping[str, Any], engine: Mapping[str, Any]) -> float | None:
    return run["output_throughput"] / engine["output_throughput"] if engine["output_throughput"] else None


def plot(
    label: str, runs: Sequence[Mapping[str, Any]], engine_runs: Sequence[Mapping[str, Any]], path: str
) -> None:
    """Latency and throughput against load, one point per load, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    by_conc = all(r["load"]["max_concurrency"] for r in runs)
    x = [r["load"]["max_concurrency"] if by_conc else float(r["load"]["request_rate"]) for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][stat] for r in runs], style, label=f"{stat}")
        ax.set_title(title)
    axes[2].plot(x, [r["output_throughput"] for r in runs], "o-", label=runs[0]["backend"])
    if engine_runs:
        axes[2].plot(x, [r["output_throughput"] for r in engine_runs], "s--", label="engine alone")
    axes[2].set_title("Output throughput (tok/s)")
    for ax in axes:
        ax.set_xlabel("max concurrency" if by_conc else "request rate (req/s)")
        if len(x) > 1 and max(x) >= 8 * min(x):
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.suptitle(f"pdserve bench: {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
