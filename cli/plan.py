"""`pdserve plan`: the planner's loop. Each round reads the nodes and their roles from the index, scrapes the
router's and the nodes' /metrics (cli/plan_measure.py), sizes the roles and picks the nodes to move
(cli/plan_model.py), logs the decision with its inputs as one JSON line, exports it, and with --apply changes
the roles through the nodes' authenticated role route (`kvctl role`'s function).

Invariants: one decision per round, each logged once (logger `pdserve.plan`, message `decision {json}`);
a node's dwell counts from the last role change this planner made (a restarted planner starts with every
node eligible); nothing moves until the planner has watched one whole stabilisation window (after its start
and after each move it made); draining nodes and single nodes are never planned or moved;
a failed scrape or a refused role change is logged and the loop goes on (--watch), or ends the command with
one line and exit 1 (a single decision).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httpx2
from pdserve.cli.plan_measure import RateEstimate, Scrape, bench_load, scrape, window
from pdserve.cli.plan_model import (
    Damping,
    Load,
    NodeView,
    PlanRole,
    Rates,
    RoleChange,
    Slo,
    decide,
    decode_slots,
    inputs_record,
    need,
)
from pdserve.cli.plan_options import PlanOptions
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.metrics import MetricsRegistry

log = logging.getLogger("pdserve.plan")
ApplyRole = Callable[[str, PlanRole], Awaitable[object]]
"""Changes one node's role (and returns once the node has taken the change)."""


@dataclass(frozen=True)
class PlanConfig:
    slo: Slo
    damping: Damping
    prior: Rates
    router_url: str | None
    """None: the load comes from `bench_result`."""
    bench_result: str | None
    window_s: float
    watch_s: float | None
    api_key: str | None = None


class PlannerMetrics(MetricsRegistry):
    """The planner's series: what it wants (for an HPA), what it decided and what it measured."""

    def __init__(self) -> None:
        super().__init__()
        self.desired = self.gauge(
            "pdserve_desired_nodes", "Nodes the measured load needs under the SLOs, by role.", ["role"]
        )
        self.decisions = self.counter(
            "pdserve_planner_decisions",
            "Planner decisions by outcome: move, dwell, hysteresis, balanced, idle, too_few_nodes.",
            ["reason"],
        )
        self.role_changes = self.counter(
            "pdserve_planner_role_changes", "Role changes the planner applied, by new role.", ["role"]
        )
        self.inputs = self.gauge(
            "pdserve_planner_input",
            "The latest decision's inputs: rate (requests/s), prompt_tokens and output_tokens (means), "
            "prefill_tokens_per_s, decode_step_s, decode_step_s_per_seq, decode_slots (sequences a decode "
            "node runs at once at most), need_prefill and need_decode (fractional nodes).",
            ["input"],
        )


class Planner:
    """One planner's state across rounds: the scrapes of the last `window_s` (the load is measured over
    them, so requests that end in bursts do not read as a rate that jumps), the rate estimate (from the
    last interval) and when it moved each node."""

    def __init__(self, cfg: PlanConfig, index: BlockIndex, client: httpx2.AsyncClient,
                 metrics: PlannerMetrics, apply_role: ApplyRole | None) -> None:  # fmt: skip
        self.cfg, self.index, self.client = cfg, index, client
        self.metrics, self.apply_role = metrics, apply_role
        self.estimate = RateEstimate(cfg.prior)
        self.changed_at: dict[str, float] = {}
        self.history: deque[Scrape] = deque()
        self.ideals: deque[tuple[float, float]] = deque()
        """(time, ideal prefill count) of the rounds within the stabilisation window."""
        self.bench = None if cfg.bench_result is None else bench_load(cfg.bench_result)

    async def round(self, now: float) -> dict[str, Any] | None:
        """Scrapes, and (from the second round on) decides; returns the decision's record."""
        statuses = [
            s for s in await self.index.nodes() if s.info.role in ("prefill", "decode") and not s.draining
        ]
        views = [
            NodeView(s.info.node_id, cast("PlanRole", s.info.role), s.load.running if s.load else 0,
                     self.changed_at.get(s.info.node_id))
            for s in statuses
        ]  # fmt: skip
        urls: dict[str, str] = {s.info.node_id: s.info.http_url for s in statuses}
        new = await scrape(self.client, now, self.cfg.router_url, urls, self.cfg.api_key)
        history = self.history
        history.append(new)
        if len(history) == 1:
            return None
        while len(history) > 2 and new.t - history[1].t >= self.cfg.window_s:
            history.popleft()  # history[0]: the newest scrape at least window_s old (or the oldest)
        roles = {v.node_id: v.role for v in views}
        self.estimate.observe(window(history[-2], new, roles))
        w = window(history[0], new, roles)
        load = self.bench or w.load or Load(0.0, 0.0, 0.0)
        rates = self.estimate.rates()
        slots = min(
            (decode_slots(load, s.info.max_num_seqs, s.info.capacity_blocks, s.info.block_size)
             for s in statuses),
            default=math.inf,
        )  # fmt: skip
        needed = need(load, rates, self.cfg.slo, slots)
        window_s, ideals = self.cfg.damping.stabilize_s, self.ideals
        while len(ideals) > 1 and now - ideals[1][0] >= window_s:
            ideals.popleft()  # ideals[0]: the newest round at least window_s old
        recent = [i for _, i in ideals]
        if window_s > 0 and (not ideals or now - ideals[0][0] < window_s):
            # the window is not covered yet (the planner started, or just moved nodes): hold the split
            recent.append(float(sum(1 for v in views if v.role == "prefill")))
        decision = decide(needed, views, self.cfg.damping, now, recent)
        if decision.reason not in ("idle", "role_missing", "too_few_nodes"):
            self.ideals.append((now, decision.ideal_prefill))
        if decision.changes and self.apply_role is not None:
            self.ideals.clear()  # the split changes: the window starts again from it
        record = inputs_record(
            load, rates, self.cfg.slo, needed, decision, {v.node_id: v.role for v in views}, slots
        )
        record |= {"window_s": round(w.seconds, 3), "observed_ttft_s": w.observed_ttft_s,
                   "observed_itl_s": w.observed_itl_s}  # fmt: skip
        self._export(record, needed.prefill, needed.decode)
        if self.apply_role is not None and decision.changes:
            record["applied"] = await self._apply(decision.changes, now)
        log.info("decision %s", json.dumps(record, default=str))
        return record

    def _export(self, record: dict[str, Any], need_p: float, need_d: float) -> None:
        m = self.metrics
        for role, count in record["desired"].items():
            m.desired.labels(role=role).set(count)
        m.decisions.labels(reason=record["reason"]).inc()
        values = {**record["load"], **record["rates"], "need_prefill": need_p, "need_decode": need_d,
                  "decode_slots": record["decode_slots"] or math.inf}  # fmt: skip
        for name, value in values.items():
            m.inputs.labels(input=name).set(value)

    async def _apply(self, changes: Sequence[RoleChange], now: float) -> list[dict[str, Any]]:
        assert self.apply_role is not None
        done: list[dict[str, Any]] = []
        for change in changes:
            try:
                await self.apply_role(change.node_id, change.to)
            except Exception as exc:  # a refusal (KvctlError) or an unreachable node: log it, keep planning
                log.warning("role change of %s to %s failed: %s", change.node_id, change.to, exc)
                done.append({"node_id": change.node_id, "to": change.to, "error": str(exc)[:300]})
                continue
            self.changed_at[change.node_id] = now
            self.metrics.role_changes.labels(role=change.to).inc()
            done.append({"node_id": change.node_id, "to": change.to, "error": None})
        return done


async def run(planner: Planner, cfg: PlanConfig) -> dict[str, Any]:
    """Rounds every --watch seconds until cancelled, or one decision over --window (its record)."""
    period = cfg.watch_s or cfg.window_s
    await planner.round(time.monotonic())
    while True:
        await asyncio.sleep(period)
        try:
            record = await planner.round(time.monotonic())
        except httpx2.HTTPError as exc:
            if cfg.watch_s is None:
                raise
            log.warning("scrape failed, no decision this round: %r", exc)
            continue
        if cfg.watch_s is None and record is not None:
            return record


def _config(opts: PlanOptions, api_key: str | None) -> PlanConfig:
    return PlanConfig(
        slo=Slo(opts.ttft_slo_ms / 1000, opts.tpot_slo_ms / 1000),
        damping=Damping(opts.margin, opts.dwell, opts.stabilize),
        prior=Rates(opts.prefill_tokens_per_s, opts.decode_step_s, opts.decode_step_s_per_seq),
        router_url=None if opts.bench_result else opts.router_url,
        bench_result=opts.bench_result,
        window_s=opts.window,
        watch_s=opts.watch,
        api_key=api_key,
    )


async def _main(opts: PlanOptions, token: str, redis: RedisConfig, api_key: str | None) -> int:
    from pdserve.kvctl import commands
    from pdserve.shared.node.node_sign import ClusterKeys
    from prometheus_client import start_http_server

    cfg = _config(opts, api_key)
    metrics = PlannerMetrics()
    server = None
    if opts.metrics_port is not None and opts.watch is not None:
        server, _ = start_http_server(opts.metrics_port, registry=metrics.registry)
    try:
        async with BlockIndex(redis, ClusterKeys(token)) as index, httpx2.AsyncClient(timeout=10.0) as client:
            apply_role: ApplyRole | None = None
            if opts.apply:

                async def apply_role(node_id: str, role: PlanRole) -> object:
                    return await commands.role(index, node_id, role, token, wait_s=opts.role_timeout)

            planner = Planner(cfg, index, client, metrics, apply_role)
            # SIGINT/SIGTERM end the loop at once, a round's role change too: the node finishes its change
            # on its own (a planner in a pod has its grace period, not a role change's minutes)
            work = asyncio.ensure_future(run(planner, cfg))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, work.cancel)
            record: dict[str, Any] | None = None
            with contextlib.suppress(asyncio.CancelledError):
                record = await work
    finally:
        if server is not None:
            server.shutdown()
    if record is not None:
        if opts.json_output:
            print(json.dumps(record, default=str))
        else:
            desired = record["desired"]
            print(f"desired nodes: prefill {desired['prefill']}, decode {desired['decode']}")
            split = f"{record['target_prefill']} prefill of {len(record['nodes'])}"
            print(f"split of the nodes: {split} ({record['reason']})")
            for change in record["changes"]:
                print(f"change {change['node_id']} to {change['to']}")
    return 0


def main(opts: PlanOptions) -> int:
    """The command: one line on stderr and exit 1 when Redis, the router or a node cannot be read."""
    from pdserve.shared.cli.settings import SettingsError, read_secret
    from pdserve.shared.index.block_index_types import BlockIndexError

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s plan %(levelname)s: %(message)s")  # fmt: skip
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per scrape would bury the decisions
    token = opts.auth_token()
    redis = opts.redis_config(opts.redis, opts.cluster)
    api_key = read_secret("api_key", "a router API key", opts.api_key_file, required=False)
    if opts.metrics_port is not None and opts.watch is None:
        raise SettingsError("--metrics-port needs --watch SECONDS (a single decision serves nothing)")
    try:
        return asyncio.run(_main(opts, token, redis, api_key))
    except (httpx2.HTTPError, BlockIndexError) as exc:
        print(f"pdserve plan: error: {exc!r}"[:400], file=sys.stderr)
        return 1
