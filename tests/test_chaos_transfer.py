"""Transfer faults under load (issue 20): a transfer cut in the middle of a frame, a corrupted frame, and a
silent prefill node (SIGSTOP while it transfers). One cluster of real processes (redis-server, one prefill and
one decode node, the router); P reaches D's transfer port through a proxy that parses P's frames
(tests/harness/transfer_proxy.py) and does the fault to the next DATA frame; both nodes ping with a 1.5 s
liveness window.

Each scenario asserts: every request ends within its deadline with the undisturbed greedy text (D computes
the prompt whose KV did not arrive: kv_load_failure_policy=recompute) or a clean OpenAI-style error; none
hangs; D did compute at least one prompt itself; no block is held on either node once the load stops. A last
scenario, on a cluster of its own, checks that D under kv_load_failure_policy=fail computes nothing. Each
prints its row of the chaos table in docs/benchmarks.md (`pytest -s`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from pdserve.cli.up import free_port
from pdserve.tests.harness.chaos_faults import SMALL_KV, reference
from pdserve.tests.harness.chaos_load import Load
from pdserve.tests.harness.cluster_fixture import LiveCluster, served_model_name, up_config
from pdserve.tests.harness.transfer_proxy import FrameProxy

pytestmark = pytest.mark.slow

MODEL = served_model_name()
WORKERS = 4
MAX_TOKENS = 8
TIMEOUT_S = 60.0
LIVENESS_S = 1.5
PROMPTS = [
    " ".join(f"Clause {i}: tenant {t} keeps room {i} clean and pays on day {i}." for i in range(1, 13))
    + f" Who is tenant {t}?"
    for t in ("Ann", "Bob", "Cy")
]
"""About 200 tokens each: several DATA frames per transfer."""
RECOMPUTED = ("pdserve_kv_transfers_total", {"outcome": "recomputed"})


@contextlib.contextmanager
def proxied_cluster(*decode_args: str) -> Iterator[tuple[LiveCluster, FrameProxy]]:
    d_transfer = free_port()
    proxy = FrameProxy(d_transfer).start()
    d_args = ("--transfer-port", str(d_transfer), "--transfer-advertise", f"tcp://127.0.0.1:{proxy.port}")
    cfg = up_config(
        prefill=1, decode=1, extra_node_args=(*SMALL_KV, "--transfer-liveness-s", str(LIVENESS_S)),
        role_node_args=(("decode", (*d_args, *decode_args)),),
    )  # fmt: skip
    try:
        live = LiveCluster.start(cfg)
        try:
            yield live, proxy
        finally:
            live.stop()
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def proxied() -> Iterator[tuple[LiveCluster, FrameProxy]]:
    with proxied_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(proxied: tuple[LiveCluster, FrameProxy]) -> dict[str, str]:
    return reference(proxied[0], MODEL, PROMPTS, MAX_TOKENS)


def run(
    proxied: tuple[LiveCluster, FrameProxy],
    expected: dict[str, str],
    scenario: str,
    fault: Callable[[LiveCluster, FrameProxy], None],
    computes: bool = True,
) -> None:
    """The load, the fault, 3 s more load, then every check; `computes`: whether D must have computed at
    least one prompt itself (kv_load_failure_policy recompute) or none (fail)."""
    live, proxy = proxied
    recomputed_before = live.metric("decode-0", *RECOMPUTED)
    load = Load(live.base, MODEL, PROMPTS, WORKERS, MAX_TOKENS, TIMEOUT_S)
    load.start()
    try:
        load.wait_until(lambda outs: sum(o.kind == "ok" for o in outs) >= 2, 120)
        fault_at = time.monotonic()
        fault(live, proxy)
        time.sleep(3.0)  # more load after the fault
    finally:
        outcomes = load.stop()
    hung = [o for o in outcomes if o.kind == "hung"]
    assert not hung, f"{len(hung)} requests hung past their {TIMEOUT_S:.0f} s deadline"
    broken = [(o.status, o.error) for o in outcomes if o.kind == "broken"]
    assert not broken, f"requests without a clean end: {broken[:5]}"
    errors = [o for o in outcomes if o.kind == "error"]
    assert all(o.error and o.error.get("message") and o.error.get("type") for o in errors), errors[:3]
    wrong = [(o.prompt[-14:], o.text) for o in outcomes if o.kind == "ok" and o.text != expected[o.prompt]]
    assert not wrong, f"completed with another text than the undisturbed run: {wrong[:3]}"
    recomputed = live.metric("decode-0", *RECOMPUTED) - recomputed_before
    assert (recomputed >= 1) == computes, f"the decode node computed {recomputed} prompts itself"
    audits = live.wait_clean(timeout_s=60)
    leaked = sum(a["in_use"] + a["reserved"] for a in audits.values())
    failed_until = max(((o.ended or fault_at) - fault_at for o in errors), default=0.0)
    on_d = f"0 ({int(recomputed)} computed on D)"
    row = (scenario, len(outcomes), sum(o.kind == "ok" for o in outcomes), len(errors), 0, 0,
           f"{failed_until:.2f}", "-", leaked, len(wrong), on_d)  # fmt: skip
    print("\n| " + " | ".join(str(c) for c in row) + " |")
    for o in errors:
        print(f"  failed cleanly: {o.response_id} after {len(o.events)} events: {o.error}")


def strike(mode: str) -> Callable[[LiveCluster, FrameProxy], None]:
    def fault(live: LiveCluster, proxy: FrameProxy) -> None:
        proxy.arm(mode)
        assert proxy.struck.wait(60), f"no DATA frame passed the proxy to {mode}"

    return fault


def test_a_corrupted_frame(proxied: tuple[LiveCluster, FrameProxy], expected: dict[str, str]) -> None:
    run(proxied, expected, "corrupted DATA frame (one payload byte flipped)", strike("corrupt"))


def test_a_transfer_cut_mid_frame(proxied: tuple[LiveCluster, FrameProxy], expected: dict[str, str]) -> None:
    run(proxied, expected, "transfer cut in the middle of a DATA frame", strike("cut"))


def test_a_silent_prefill_node(proxied: tuple[LiveCluster, FrameProxy], expected: dict[str, str]) -> None:
    """SIGSTOP of P's process group while a transfer runs, for the liveness window and a few seconds more;
    then SIGCONT (P survives: its blocks are audited too)."""

    def fault(live: LiveCluster, proxy: FrameProxy) -> None:
        strike("mark")(live, proxy)
        pid = next(p.pid for n, p in live.cluster.procs if n == "prefill-0")
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(LIVENESS_S + 3.0)
        finally:
            os.killpg(pid, signal.SIGCONT)

    run(proxied, expected, "prefill node SIGSTOP mid-transfer (liveness 1.5 s)", fault)


def test_under_the_fail_policy_d_computes_nothing() -> None:
    """`--kv-load-failure-policy fail`: a corrupted frame's request ends on D with an error (which the router,
    nothing having streamed, places again: every request still ends with its text or a clean error), and D
    computes no prompt itself."""
    with proxied_cluster("--kv-load-failure-policy", "fail") as cluster:
        texts = reference(cluster[0], MODEL, PROMPTS, MAX_TOKENS)
        run(cluster, texts, "corrupted DATA frame, kv_load_failure_policy=fail", strike("corrupt"), False)
