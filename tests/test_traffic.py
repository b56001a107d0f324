"""The traffic test (issue 17): real clusters (1P+1D, 1P+2D, 2P+2D; one per seed) under a seeded random mix
of ordinary requests through the official `openai` client, with `kvctl evict`, `drain` and `undrain` between
waves of concurrent requests.

The mix: chat and completions, streamed and not, max_tokens 1..64, n 1..4, stop strings, two long system
prompts and two long documents shared by many requests (so P's and D's prefix caches both matter, and an
evict on one of them leaves a prefix cached on the other), and one request over the context. Every choice
of every request must equal its greedy reference from ONE offline run of `pdserve generate --prompts-file`
over the seed's prompts (chat through the template the router applies; each line carries the request's
max_tokens and stop), or, only where the test expects one, be a clean OpenAI error. At the end every
node's pool audit is clean (in_use = reserved = pinned = 0, no live request). The seed, the cluster and the
whole mix are printed first; `pytest tests/test_traffic.py -k seed2` replays one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx2
import openai
import pytest
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
SHAPES = {1: (1, 1), 2: (1, 2), 3: (2, 2)}
"""Seed -> (prefill nodes, decode nodes)."""
WAVES = 8
WAVE_SIZE = (4, 6)
ROUTER_TTL_S = 1.5
"""Past the router's node-list reuse window (node_list_ttl_s = 1 s), so it sees a drain or an undrain."""
OVER_CONTEXT_MAX_TOKENS = 9000
"""SmolLM2's context is 8192 tokens: the router refuses this with 400 before any node works."""

SYSTEMS = (
    "You are the help desk assistant of the Northwind Regional Library. Answer the visitor's question in "
    "one or two short sentences, politely and plainly. The library opens at nine in the morning and closes "
    "at eight in the evening on weekdays, and at five on Saturdays; it is closed on Sundays and public "
    "holidays. Members may borrow up to twelve items at once for three weeks, and renew each item twice "
    "online unless another member has reserved it. Late returns cost ten cents a day per item. The reading "
    "room on the second floor is silent; group study rooms on the third floor can be booked for two hours "
    "at the front desk. Printing costs fifteen cents a page. Never invent services the library does not "
    "offer; if you do not know, say so and suggest asking at the front desk.",
    "You are a careful assistant for a small bicycle repair shop called Spoke and Chain. Customers write in "
    "with questions about repairs, parts and prices. A basic tune-up costs forty-five dollars and takes one "
    "day; a full overhaul costs one hundred and twenty dollars and takes three days. Flat tyres are fixed "
    "while the customer waits, for twelve dollars including the tube. The shop sells helmets, lights, locks "
    "and tyres but does not sell complete bicycles. It is open from Tuesday to Saturday, ten to six. Keep "
    "every answer short, friendly and factual, and recommend a safety check when a customer mentions "
    "brakes, a crash or a wobbling wheel.",
)
DOCUMENTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press. Within a few decades, print shops had "
    "spread to more than two hundred cities across Europe, and the cost of books fell sharply. Scholars, "
    "merchants and clergy could now own texts that had once been copied by hand over many months. "
    "Standardised editions let readers in different cities refer to the same page and the same wording, "
    "which made it easier to compare observations, correct errors and build on the work of others. "
    "Pamphlets and broadsheets carried news and arguments quickly, and literacy rose as printed primers "
    "became cheap. Governments and churches soon tried to license printers and censor what they produced, "
    "but the sheer number of presses made complete control impossible.",
    "Honeybees live in colonies of tens of thousands of workers, a few hundred drones and a single queen. "
    "Workers change jobs as they age: young bees clean cells and feed larvae, middle-aged bees build comb "
    "and guard the entrance, and the oldest bees forage for nectar, pollen, water and resin. A forager that "
    "finds a rich patch of flowers returns to the hive and performs a waggle dance, whose angle tells the "
    "others the direction of the food relative to the sun and whose duration tells them the distance. "
    "Nectar is stored in wax cells and fanned by the bees' wings until most of its water evaporates and it "
    "becomes honey. In winter the colony clusters tightly and shivers its flight muscles to keep the queen "
    "warm, living on the honey it stored during the summer.",
)
QUESTIONS = (
    "What is the main point?",
    "Summarise this in one sentence.",
    "Give one example.",
    "Why does it matter?",
    "What happens next?",
    "List three key facts.",
    "Explain it to a child.",
    "What is surprising here?",
    "Write a title for it.",
    "What question would you ask?",
    "Describe the first step.",
    "Is there a cost?",
)
STOPS = (".", "\n", ",", " the", "!", "?", " and")

REQUEST_TIMEOUT_S = 120.0
NODE_ARGS = ("--kv-cache-gib", "0.25")
"""364 blocks per node, a few times what one wave holds at once; the default 1 GiB pool makes each node
about 2.4 GB resident, and four of them beside the test crowd a CI machine's memory."""

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class Call:
    """One request of the mix. `expect`: the HTTP status the test expects (200: every choice is the
    reference text; otherwise a clean OpenAI error with that status)."""

    number: int
    kind: Kind
    text: str
    """The completion prompt, or the chat's user message."""
    system: str | None
    max_tokens: int
    stop: tuple[str, ...]
    n: int
    stream: bool
    expect: int = 200

    def messages(self) -> Any:
        """The chat's messages (Any: the openai client types them as TypedDicts)."""
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*head, {"role": "user", "content": self.text}]

    def reference_line(self) -> str:
        """Its line of the offline prompts file (without n: every greedy choice is the same text)."""
        line: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": list(self.stop)}
        line |= {"messages": self.messages()} if self.kind == "chat" else {"prompt": self.text}
        return json.dumps(line, sort_keys=True)

    def family(self) -> str:
        """Which shared prefixes it starts with (system prompt, document), or 'plain'."""
        names = [] if self.system is None else [f"system{SYSTEMS.index(self.system)}"]
        names += [f"doc{i}" for i, d in enumerate(DOCUMENTS) if self.text.startswith(d)]
        return "+".join(names) or "plain"

    def describe(self) -> str:
        question = next(q for q in QUESTIONS if q in self.text)
        stream = "stream " if self.stream else ""
        expect = "" if self.expect == 200 else f" -> expect {self.expect}"
        return (
            f"#{self.number} {self.kind} {stream}[{self.family()}] {question!r} n={self.n} "
            f"max_tokens={self.max_tokens} stop={list(self.stop)}{expect}"
        )


@dataclass(frozen=True)
class Op:
    """An operator's kvctl action between two waves. evict: `call`'s prompt blocks, or all with None.
    drain with a `probe`: the node is its role's only one, so the probe must get 503 before the undrain
    that follows at once."""

    action: Literal["evict", "drain", "undrain"]
    node: str
    call: Call | None = None
    probe: Call | None = None

    def describe(self) -> str:
        if self.action == "evict":
            return f"kvctl evict --node {self.node} " + (
                "--all" if self.call is None else f"<prompt of #{self.call.number}>"
            )
        if self.probe is not None:
            return f"kvctl drain {self.node}; {self.probe.describe()}; kvctl undrain {self.node}"
        return f"kvctl {self.action} {self.node}"


@dataclass(frozen=True)
class Mix:
    waves: tuple[tuple[Call, ...], ...]
    ops: tuple[tuple[Op, ...], ...]
    """ops[i] runs after waves[i] (one entry fewer than waves)."""

    def calls(self) -> list[Call]:
        return [c for wave in self.waves for c in wave] + [
            o.probe for ops in self.ops for o in ops if o.probe
        ]

    def summary(self) -> str:
        calls = self.calls()
        ops = [o for slot in self.ops for o in slot]

        def count(pred: Any) -> int:
            return sum(1 for c in calls if pred(c))

        return (
            f"{len(calls)} requests in {len(self.waves)} waves: {count(lambda c: c.kind == 'chat')} chat, "
            f"{count(lambda c: c.stream)} streamed, {count(lambda c: c.n > 1)} with n > 1, "
            f"{count(lambda c: c.max_tokens == 1)} with max_tokens=1, {count(lambda c: c.stop)} with stop, "
            f"{count(lambda c: c.family() != 'plain')} on a shared prefix, "
            f"{count(lambda c: c.expect != 200)} expecting an error; "
            f"{sum(o.action == 'evict' for o in ops)} evicts, {sum(o.action == 'drain' for o in ops)} drains"
        )

    def lines(self, seed: int, shape: str) -> list[str]:
        out = [f"traffic seed={seed} cluster={shape}: {self.summary()}"]
        for i, wave in enumerate(self.waves):
            out += [f"wave {i}:"] + [f"  {c.describe()}" for c in wave]
            out += [f"  then {o.describe()}" for o in (self.ops[i] if i < len(self.ops) else ())]
        return out


def make_call(rng: random.Random, number: int) -> Call:
    kind: Kind = rng.choice(("chat", "completion"))
    question = rng.choice(QUESTIONS)
    document = rng.choice((*DOCUMENTS, *DOCUMENTS, ""))
    system = rng.choice((*SYSTEMS, *SYSTEMS, None)) if kind == "chat" else None
    text = question if kind == "chat" else f"Question: {question}\nAnswer:"
    text = f"{document}\n\n{text}" if document else text
    max_tokens = rng.choice((1, 1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64))
    stop = tuple(rng.sample(STOPS, rng.randint(1, 2))) if rng.random() < 0.35 else ()
    n = rng.choices((1, 2, 3, 4), weights=(6, 2, 1, 1))[0]
    return Call(number, kind, text, system, max_tokens, stop, n, stream=rng.random() < 0.5)


def make_mix(seed: int, prefill: int, decode: int) -> Mix:
    """WAVES waves of 4-6 calls, one of them over the context (400). Between waves: two D caches and one
    P cache evicted whole and one prompt's blocks evicted from some node, so prefixes end up cached on P
    but not on D and the reverse; one P and one D drained, and undrained one or two waves later (a role's
    only D at once, with a probe request that must get 503 in between); after an undrain the node must be
    listed as serving again before the next wave."""
    rng = random.Random(seed)
    waves: list[tuple[Call, ...]] = []
    for _ in range(WAVES):
        first = sum(len(w) for w in waves)
        waves.append(tuple(make_call(rng, first + i) for i in range(rng.randint(*WAVE_SIZE))))
    for w in (0, WAVES - 1):  # every node serves these two waves: max_tokens=1 goes through P and D
        waves[w] = (*waves[w][:-1], dataclasses.replace(waves[w][-1], max_tokens=1))
    over = rng.randrange(1, WAVES - 1)
    picked = rng.randrange(len(waves[over]))
    waves[over] = tuple(
        dataclasses.replace(c, max_tokens=OVER_CONTEXT_MAX_TOKENS, expect=400) if i == picked else c
        for i, c in enumerate(waves[over])
    )
    ps = [f"prefill-{i}" for i in range(prefill)]
    ds = [f"decode-{i}" for i in range(decode)]
    ops: list[list[Op]] = [[] for _ in range(WAVES - 1)]
    drained: list[tuple[str, int, int]] = []  # node, drained after wave, undrained after wave
    for node in (rng.choice(ps), rng.choice(ds)):
        start = rng.randrange(WAVES - 2)
        if node in ds and len(ds) == 1:
            probe = make_call(rng, sum(len(w) for w in waves))
            ops[start].append(Op("drain", node, probe=dataclasses.replace(probe, expect=503)))
            continue
        end = min(WAVES - 2, start + rng.randint(1, 2))
        ops[start].append(Op("drain", node))
        ops[end].append(Op("undrain", node))
        drained.append((node, start, end))
    for nodes, whole in ((ds, True), (ds, True), (ps, True), (ps + ds, False)):
        slot = rng.randrange(WAVES - 1)
        live = [n for n in nodes if not any(d == n and s <= slot <= e for d, s, e in drained)]
        shared = [c for w in waves[: slot + 1] for c in w if c.expect == 200 and c.family() != "plain"]
        if live and (whole or shared):
            ops[slot].insert(0, Op("evict", rng.choice(live), None if whole else rng.choice(shared)))
    return Mix(tuple(waves), tuple(tuple(o) for o in ops))


@dataclass
class Outcome:
    """What the client got: each choice's text and finish reason, the usage (prompt, completion tokens),
    or the error."""

    texts: dict[int, str]
    finish: dict[int, str | None]
    usage: tuple[int, int] | None = None
    error: Exception | None = None


def send(client: openai.OpenAI, call: Call) -> Outcome:
    """One request through the official client; an error it raises becomes the outcome."""
    out = Outcome({}, {})
    chat = call.kind == "chat"
    create: Any = client.chat.completions.create if chat else client.completions.create
    args: dict[str, Any] = {"model": MODEL, "max_tokens": call.max_tokens, "n": call.n, "temperature": 0}
    args |= {"messages": call.messages()} if chat else {"prompt": call.text}
    args |= {"stop": list(call.stop)} if call.stop else {}
    args |= {"stream": True, "stream_options": {"include_usage": True}} if call.stream else {}
    try:
        for response in create(**args) if call.stream else [create(**args)]:
            if response.usage:
                out.usage = (response.usage.prompt_tokens, response.usage.completion_tokens)
            for choice in response.choices:
                out.texts[choice.index] = out.texts.get(choice.index, "") + _text(choice)
                out.finish[choice.index] = choice.finish_reason or out.finish.get(choice.index)
    except (openai.OpenAIError, httpx2.HTTPError) as exc:
        out.error = exc
    return out


def _text(choice: Any) -> str:
    """A choice's text: a completion's `text`, a chat's `message` or a chat chunk's `delta` content."""
    holder = getattr(choice, "message", None) or getattr(choice, "delta", None)
    text = choice.text if holder is None else holder.content
    return text or ""


def check(call: Call, out: Outcome, refs: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the outcome: [] when every choice is the reference (or the expected error)."""
    if call.expect != 200:
        error = out.error
        if not isinstance(error, openai.APIStatusError) or error.status_code != call.expect:
            return [f"expected a clean {call.expect} error, got {_said(out)}"]
        body = error.body
        if not isinstance(body, dict) or not body.get("message") or not body.get("type"):
            return [f"the {call.expect} error is not an OpenAI error object: {body!r:.200}"]
        return []
    if out.error is not None:
        return [_said(out)]
    ref = refs[call.reference_line()]
    problems = []
    if sorted(out.texts) != list(range(call.n)):
        problems.append(f"choices {sorted(out.texts)}, expected {call.n}")
    for i, text in sorted(out.texts.items()):
        if (text, out.finish.get(i)) != (ref["text"], ref["finish_reason"]):
            want = f"{ref['text']!r} ({ref['finish_reason']})"
            problems.append(f"choice {i}: {text!r} ({out.finish.get(i)}) != reference {want}")
    usage = (len(ref["prompt_token_ids"]), call.n * len(ref["token_ids"]))
    if out.usage != usage:
        problems.append(f"usage (prompt, completion) {out.usage} != {usage}")
    return problems


def _said(out: Outcome) -> str:
    error = out.error
    if isinstance(error, openai.APIStatusError):
        return f"{error.status_code} {error.body!r:.300}"
    return f"{type(error).__name__}: {error}" if error is not None else f"200 {out.texts!r:.200}"


def apply(
    live: cluster_fixture.LiveCluster, op: Op, client: openai.OpenAI, refs: dict[str, dict[str, Any]]
) -> list[str]:
    """Runs one kvctl action (the real kvctl, with the cluster's credential); returns problems found."""
    try:
        return _apply(live, op, client, refs)
    except AssertionError as exc:  # kvctl exited non-zero, or the node did not come back
        return [f"{op.describe()}: {exc}"]


def _apply(
    live: cluster_fixture.LiveCluster, op: Op, client: openai.OpenAI, refs: dict[str, dict[str, Any]]
) -> list[str]:
    redis = live.redis_url
    if op.action == "evict":
        target = ["--all"] if op.call is None else _prompt_args(op.call)
        reply = cluster_fixture.kvctl_main(redis, "evict", "--node", op.node, *target)
        return [] if reply["node_reply"].get("ok") else [f"{op.describe()}: {reply}"]
    if op.action == "undrain":
        _undrain(live, op.node)
        return []
    cluster_fixture.kvctl_main(redis, "drain", op.node)
    if op.probe is None:
        return []
    time.sleep(ROUTER_TTL_S)
    problems = [f"{op.probe.describe()}: {p}" for p in check(op.probe, send(client, op.probe), refs)]
    _undrain(live, op.node)
    return problems


def _undrain(live: cluster_fixture.LiveCluster, node: str) -> None:
    """kvctl undrain, then waits until the index lists the node as serving and the router has seen it."""
    cluster_fixture.kvctl_main(live.redis_url, "undrain", node, "--url", live.nodes[node].url)
    deadline = time.monotonic() + 60
    while not _serving(live, node):
        assert time.monotonic() < deadline, f"{node} is not back in the index 60 s after its undrain"
        time.sleep(0.3)
    time.sleep(ROUTER_TTL_S)


def _prompt_args(call: Call) -> list[str]:
    if call.kind == "chat":
        return ["--messages", json.dumps(call.messages())]
    return ["--prompt", call.text]


def _serving(live: cluster_fixture.LiveCluster, node: str) -> bool:
    nodes = {n["info"]["node_id"]: n for n in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]}
    return node in nodes and not nodes[node]["draining"]


def cluster_cpu_s(live: cluster_fixture.LiveCluster) -> float:
    """CPU seconds the cluster's processes (nodes, router) have used so far, from /proc (Linux): the cost of
    the run on an otherwise idle machine, where wall time depends on what else runs."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for _, proc in live.cluster.procs:
        try:
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
                fields = f.read().rpartition(")")[2].split()
        except FileNotFoundError:  # exited and reaped: error_lines reports it
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def error_lines(live: cluster_fixture.LiveCluster, per_node: int = 6) -> list[str]:
    """The last error-looking lines of every process's log, to name the defect behind a failure, and the
    log's tail for a process that exited."""
    pattern = re.compile(r"error|exception|traceback|abort|missing|refus", re.IGNORECASE)
    out = []
    for name, proc in live.cluster.procs:
        lines = live.log(name).splitlines()
        if proc.poll() is not None:
            out += [f"  {name} EXITED with {proc.returncode}; its log ends:"]
            out += [f"  {name}: {line[:300]}" for line in lines[-25:]]
            continue
        hits = [line for line in lines if pattern.search(line)]
        out += [f"  {name}: {line[:300]}" for line in hits[-per_node:]]
    return out


SEEDS = [pytest.param(seed, id=f"seed{seed}-{p}P{d}D") for seed, (p, d) in SHAPES.items()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_traffic(seed: int, tmp_path: Path) -> None:
    prefill, decode = SHAPES[seed]
    mix = make_mix(seed, prefill, decode)
    print("\n".join(mix.lines(seed, f"{prefill}P+{decode}D")), flush=True)
    lines = sorted({c.reference_line() for c in mix.calls() if c.expect == 200})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as offline:  # the reference run and the cluster's start overlap
        reference = offline.submit(cluster_fixture.generate_offline_lines, "--prompts-file", str(path))
        live = cluster_fixture.LiveCluster.start(
            cluster_fixture.up_config(prefill=prefill, decode=decode, extra_node_args=NODE_ARGS)
        )
        t1 = time.monotonic()
        try:
            refs = dict(zip(lines, reference.result(), strict=True))
        except BaseException:
            live.stop()
            raise
    try:
        t2 = time.monotonic()
        failures: list[str] = []
        with (
            openai.OpenAI(
                base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
            ) as client,
            ThreadPoolExecutor(max(WAVE_SIZE)) as pool,
        ):
            for i, wave in enumerate(mix.waves):
                outcomes = list(pool.map(lambda c: send(client, c), wave))
                failures += [
                    f"{c.describe()}: {p}"
                    for c, o in zip(wave, outcomes, strict=True)
                    for p in check(c, o, refs)
                ]
                for op in mix.ops[i] if i < len(mix.ops) else ():
                    failures += apply(live, op, client, refs)
        t3 = time.monotonic()
        cpu_s = cluster_cpu_s(live)
        try:
            live.wait_clean(timeout_s=30)
        except (AssertionError, httpx2.HTTPError) as exc:
            failures.append(f"audit at the end: {exc!r}")
        print(
            f"traffic seed={seed}: cluster up in {t1 - t0:.1f} s, {len(refs)} references by {t2 - t0:.1f} s, "
            f"{len(mix.calls())} requests in {t3 - t2:.1f} s (the cluster's processes used {cpu_s:.0f} CPU s "
            f"since they started), {len(failures)} failures",
            flush=True,
        )
        assert not failures, "\n".join(
            [f"seed {seed}: {len(failures)} failures", *failures, "logs:", *error_lines(live)]
        )
    finally:
        live.stop()
