"""Acceptance of the planner (issue 39): two prefill and two decode nodes behind one router, a workload that
shifts from long prompts with short outputs to short prompts with long outputs, and `pdserve plan --watch
--apply` (short intervals) moving the nodes' roles as it goes. Every node runs one sequence at a time
(`--max-num-seqs 1`): on a 2-core machine every node shares the same cores, so compute is no bound a role
changes, but slots are, as a decode node's KV memory is on a GPU. With the second phase's three concurrent
long outputs, two decode nodes leave one request waiting at its transfer (its TTFT past the SLO) while three
start each at once; the planner sees the slots in the nodes' registrations and moves prefill nodes to
decode. Asserted: no request fails, every text is the greedy reference, every role change the planner
applied succeeded, the planner's /metrics serves pdserve_desired_nodes, it exits cleanly, and the second
phase's goodput under fixed SLOs with the planner's split is higher than with the roles fixed at 2 P + 2 D
(both printed, with how many roles moved)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2
import pytest
from pdserve.cli.up import free_port
from pdserve.tests.harness.chaos_load import Load, Outcome
from pdserve.tests.harness.cluster_fixture import (
    LiveCluster,
    book_key,
    kvctl_main,
    reference_book,
    sample,
    secret_file,
    served_model_name,
    up_config,
)

pytestmark = pytest.mark.slow

MODEL = served_model_name()
GOODS = ("tin", "rope", "salt", "glass", "wool", "corn", "iron", "silk", "oil", "clay", "tea", "ink")
LONG = [
    f"Report {i}. " + " ".join(f"Item {i}.{j}: gate {j} shipped {i * j} crates of {w}." for j in range(1, 22))
    for i, w in enumerate(GOODS)
]
SHORT = [
    f"Write a short story about {w}." for w in ("a fox", "the sea", "a robot", "winter", "a city", "bees")
]
LONG_TOKENS, SHORT_TOKENS = 2, 96
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.3
WORKERS = 3
"""Concurrent requests in every phase: the slots of three decode nodes of one sequence each."""
MEASURED = 6
"""Requests of the second phase whose goodput is measured, per setup."""
HEARTBEAT_S = 0.25
THINK_S = 0.75
"""Each client's pause between requests, and between the clients' first requests: longer than the router's
view of the nodes' load can lag (a heartbeat and a node-list refresh), so a decode node that just finished a
stream looks free, not busy; with no pause, the next request can land behind a running stream on another
node while this one idles (the router's decode score weighs the heartbeat's running requests)."""


@pytest.fixture(scope="module")
def references() -> dict[str, str]:
    """Both phases' greedy references (every output its full length), from one offline run."""
    lines = [(p, LONG_TOKENS) for p in LONG] + [(p, SHORT_TOKENS) for p in SHORT]
    book = reference_book([{"prompt": p, "max_tokens": n} for p, n in lines], "--ignore-eos")
    return {p: book[book_key({"prompt": p, "max_tokens": n})] for p, n in lines}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    fresh = up_config(
        prefill=2,
        decode=2,
        extra_node_args=("--max-num-seqs", "1", "--heartbeat-s", str(HEARTBEAT_S)),
        router_args=("--node-list-ttl", str(HEARTBEAT_S)),
    )
    with LiveCluster.start(fresh) as cluster:
        yield cluster


def roles(live: LiveCluster) -> dict[str, str]:
    return {n["info"]["node_id"]: n["info"]["role"] for n in kvctl_main(live.redis_url, "nodes")["nodes"]}


def changing(live: LiveCluster) -> bool:
    """A node's role change is under way (it shows as draining until it registers in its new role)."""
    return any(n["draining"] for n in kvctl_main(live.redis_url, "nodes")["nodes"])


def planner_metric(port: int, name: str, labels: dict[str, str] | None = None) -> float:
    return sample(httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, name, labels)


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.5)


def goodput(outcomes: list[Outcome]) -> tuple[float, int]:
    """Requests per second that met both SLOs (TTFT: to the first event; TPOT: between token events), over
    the wall time from the first start to the last end; and how many met them."""
    met = 0
    for o in outcomes:
        tokens = o.events[:-1]  # the last event is [DONE]
        ttft = tokens[0] - o.started
        tpot = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        met += ttft <= TTFT_SLO_S and tpot <= TPOT_SLO_S
    wall = max(o.ended or 0.0 for o in outcomes) - min(o.started for o in outcomes)
    return met / wall, met


def run_phase(
    live: LiveCluster, prompts: list[str], max_tokens: int, until: object, timeout_s: float
) -> list[Outcome]:
    sampling = {"temperature": 0, "ignore_eos": True}  # every output its full length: the mix is what it says
    think = THINK_S if max_tokens > LONG_TOKENS else 0.0  # the first phase's load is prefill, not slots
    load = Load(live.base, MODEL, prompts, WORKERS, max_tokens=max_tokens, timeout_s=120, pause_s=think,
                sampling=sampling, stagger_s=think)  # fmt: skip
    load.start()
    try:
        wait_for(lambda: until(load.snapshot()), timeout_s, "the phase did not reach its end")  # type: ignore[operator]
    finally:
        outcomes = load.stop()
    return outcomes


def check(outcomes: list[Outcome], references: dict[str, str]) -> None:
    failed = [(o.prompt[:30], o.kind, o.error) for o in outcomes if o.kind != "ok"]
    assert not failed, f"requests failed: {failed}"
    wrong = [o.prompt[:30] for o in outcomes if o.text != references[o.prompt]]
    assert not wrong, f"texts differ from the greedy reference: {wrong}"


def test_the_planner_moves_roles_with_a_shifting_mix(references: dict[str, str], live: LiveCluster) -> None:
    port = free_port()
    log_path = os.path.join(live.cluster.workdir, "plan.log")
    with open(log_path, "wb") as log:
        planner = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "plan", "--router-url", live.base,
             "--redis", live.redis_url, "--auth-token-file", secret_file(live.auth_token),
             "--watch", "2", "--window", "6", "--dwell", "20", "--stabilize", "5", "--apply",
             "--metrics-port", str(port),
             "--ttft-slo-ms", str(TTFT_SLO_S * 1000), "--tpot-slo-ms", str(TPOT_SLO_S * 1000)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        to_prefill = lambda: planner_metric(port, "pdserve_planner_role_changes_total", {"role": "prefill"})  # noqa: E731
        to_decode = lambda: planner_metric(port, "pdserve_planner_role_changes_total", {"role": "decode"})  # noqa: E731
        wait_for(lambda: planner.poll() is None and _answers(port), 60, "the planner did not serve /metrics")
        start = time.monotonic()
        first = run_phase(
            live, LONG, LONG_TOKENS, lambda outs: to_prefill() >= 1 or time.monotonic() - start > 90, 150
        )
        print(f"\nphase 1 (long prompts): {len(first)} requests; roles {sorted(roles(live).values())}")
        assert planner_metric(port, "pdserve_desired_nodes", {"role": "prefill"}) >= 1
        start = time.monotonic()

        moved_at: list[float] = []

        def settled(outs: list[Outcome]) -> bool:
            """A node went to decode, then a second one did (a prefill node's change waits for the requests
            it holds, which wait for the one decode node's slot) or 30 s went by; or 60 s with none."""
            if not moved_at and to_decode() >= 1:
                moved_at.append(time.monotonic())
            return (bool(moved_at) and (to_decode() >= 2 or time.monotonic() - moved_at[0] > 30)) or (
                time.monotonic() - start > 60
            )

        second = run_phase(live, SHORT, SHORT_TOKENS, settled, 150)
        wait_for(lambda: not changing(live), 60, "a role change under way did not end")
        split = roles(live)
        measured = run_phase(live, SHORT, SHORT_TOKENS, lambda outs: len(outs) >= MEASURED, 150)
    finally:
        os.killpg(planner.pid, signal.SIGTERM)
        code = planner.wait(30)
    with open(log_path, encoding="utf-8") as f:
        decisions = [line for line in f if " decision {" in line]
    assert code == 0, f"the planner exited {code}"
    moved = sum(line.count('"error": null') for line in decisions)
    failed = [line for line in decisions if '"error": "' in line]
    print(f"role changes applied by the planner: {moved}; split in the second phase: {sorted(split.items())}")
    assert not failed, f"role changes the planner could not apply: {failed}"
    for outcomes in (first, second, measured):
        check(outcomes, references)

    wait_for(lambda: not changing(live), 60, "the role change the stopped planner left did not end")
    # back to 2 P + 2 D, the nodes of the role that has more than two first (each goes to the role that has
    # fewer), so no step empties a role
    fixed_roles = {"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill", "prefill-1": "prefill"}
    now = roles(live)
    surplus = {node: sum(r == role for r in now.values()) > 2 for node, role in now.items()}
    for node in sorted((n for n, r in fixed_roles.items() if now[n] != r), key=lambda n: not surplus[n]):
        kvctl_main(live.redis_url, "role", node, fixed_roles[node])
    fixed = run_phase(live, SHORT, SHORT_TOKENS, lambda outs: len(outs) >= MEASURED, 150)
    check(fixed, references)
    planned_goodput, planned_met = goodput(measured[:MEASURED])
    fixed_goodput, fixed_met = goodput(fixed[:MEASURED])
    print(f"second phase goodput (TTFT <= {TTFT_SLO_S} s, TPOT <= {TPOT_SLO_S} s): planner "
          f"{planned_goodput:.3f} req/s ({planned_met}/{MEASURED} met), fixed 2P:2D "
          f"{fixed_goodput:.3f} req/s ({fixed_met}/{MEASURED})")  # fmt: skip
    for name, outcomes in (("planner", measured), ("fixed", fixed)):
        print(f"  {name}: TTFT s {[round(o.events[0] - o.started, 2) for o in outcomes[:MEASURED]]}")
    assert planned_goodput > fixed_goodput, "the planner's split served no more requests within the SLOs"
    live.wait_clean()


def _answers(port: int) -> bool:
    try:
        return httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False
