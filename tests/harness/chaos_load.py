"""Concurrent streaming load for the chaos tests: client threads that send OpenAI streaming completions in a
loop and record, per request, when it started, each event's time, its text and how it ended.

Owns only its threads (joined by `stop()`); every request carries a client-side timeout, so a hung request
shows as outcome "hung" instead of hanging the test. An outcome is "ok" (the stream ended with [DONE] after
a finish_reason), "error" (an OpenAI-style error object, as the status body or an SSE event: a clean
failure), "left" (the client itself left early, on purpose) or "hung"/"broken" (no clean end: a bug).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2


@dataclass
class Outcome:
    prompt: str
    started: float
    """time.monotonic() when the request was sent."""
    events: list[float] = field(default_factory=list)
    """time.monotonic() of each SSE event (tokens, error, [DONE])."""
    text: str = ""
    ended: float | None = None
    kind: str = "running"
    """running, ok, error, left, hung, broken."""
    error: dict[str, Any] | None = None
    status: int | None = None
    response_id: str = ""
    """The completion's id (its node request ids are `<id>-<choice>`, in the nodes' logs)."""

    def active_at(self, t: float) -> bool:
        return self.started <= t and (self.ended is None or self.ended >= t)

    def next_event_after(self, t: float) -> float | None:
        """Time of the first event (or of the end) after t."""
        later = [e for e in self.events if e > t]
        if later:
            return later[0]
        return self.ended if self.ended is not None and self.ended > t else None


class Load:
    """`workers` threads each sending streaming completions of `prompts` (round robin) to `base` until
    `stop()`; `leave_after` (chunks) makes every `leave_every`-th request of a worker leave early; worker w
    sends its first request `w * stagger_s` after `start()` (clients that do not all arrive at once)."""

    def __init__(
        self,
        base: str,
        model: str,
        prompts: Sequence[str],
        workers: int,
        max_tokens: int = 16,
        timeout_s: float = 60.0,
        leave_every: int = 0,
        leave_after: int = 2,
        pause_s: float = 0.0,
        sampling: dict[str, Any] | None = None,
        stagger_s: float = 0.0,
    ) -> None:
        self.base = base
        self.stagger_s = stagger_s
        self.model = model
        self.prompts = list(prompts)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.leave_every = leave_every
        self.leave_after = leave_after
        self.pause_s = pause_s
        self.sampling = sampling or {"temperature": 0}
        """Sampling fields of every request (default greedy)."""
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(workers)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Outcome]:
        """Stops sending new requests, waits for the running ones (each bounded by timeout_s)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 30)
            assert not t.is_alive(), "a load thread did not end within its request timeout"
        return list(self.outcomes)

    def wait_until(self, predicate: Callable[[list[Outcome]], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.snapshot()):
            assert time.monotonic() < deadline, f"load did not reach the expected state in {timeout_s}s"
            time.sleep(0.02)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def _work(self, worker: int) -> None:
        if self._stop.wait(worker * self.stagger_s):
            return
        with httpx2.Client(timeout=httpx2.Timeout(self.timeout_s, connect=10)) as client:
            n = 0
            while not self._stop.is_set():
                prompt = self.prompts[(worker + n * len(self._threads)) % len(self.prompts)]
                leave = bool(self.leave_every) and n % self.leave_every == self.leave_every - 1
                n += 1
                out = Outcome(prompt, time.monotonic())
                with self._lock:
                    self.outcomes.append(out)
                send(client, self.base, self._body(prompt), out, self.leave_after if leave else 0)
                if self.pause_s or out.kind == "broken":  # a client backs off from a server that is gone
                    time.sleep(max(self.pause_s, 0.2))

    def _body(self, prompt: str) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            **self.sampling,
            "stream": True,
            "timeout": self.timeout_s,
        }


class Paced(Load):
    """Starts one request every 1/rate seconds (each in its own thread, whatever the others do)."""

    def __init__(self, base: str, model: str, prompts: Sequence[str], rate: float, **kw: Any) -> None:
        super().__init__(base, model, prompts, workers=1, **kw)
        self.rate = rate
        self._running: list[threading.Thread] = []

    def stop(self) -> list[Outcome]:
        super().stop()
        for t in self._running:
            t.join(self.timeout_s + 30)
            assert not t.is_alive(), "a paced request did not end within its timeout"
        return list(self.outcomes)

    def _work(self, worker: int) -> None:
        n = 0
        start = time.monotonic()
        while not self._stop.is_set():
            prompt = self.prompts[n % len(self.prompts)]
            out = Outcome(prompt, time.monotonic())
            with self._lock:
                self.outcomes.append(out)
            thread = threading.Thread(target=self._send_one, args=(out,), daemon=True)
            thread.start()
            self._running.append(thread)
            n += 1
            self._stop.wait(max(0.0, start + n / self.rate - time.monotonic()))

    def _send_one(self, out: Outcome) -> None:
        with httpx2.Client(timeout=httpx2.Timeout(self.timeout_s, connect=10)) as client:
            send(client, self.base, self._body(out.prompt), out, 0)


def send(client: httpx2.Client, base: str, body: dict[str, Any], out: Outcome, leave_after: int) -> None:
    """One streaming completion, recorded into out; leave_after > 0: leave after that many chunks."""
    finished = False
    try:
        with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = _error_of(resp.read())
                out.kind = "error" if out.error is not None else "broken"
                return
            chunks = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                out.events.append(time.monotonic())
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.kind = "ok" if finished else ("error" if out.error else "broken")
                    return
                obj = json.loads(data)
                out.response_id = out.response_id or obj.get("id", "")
                if "error" in obj:
                    out.error = obj["error"]
                    continue
                for choice in obj.get("choices", []):
                    out.text += choice.get("text", "")
                    finished = finished or choice.get("finish_reason") is not None
                chunks += 1
                if leave_after and chunks >= leave_after:
                    out.kind = "left"
                    return
            out.kind = "broken"  # the stream ended without [DONE]
    except httpx2.TimeoutException:
        out.kind = "hung"
    except httpx2.HTTPError as exc:
        out.kind = "broken"
        out.error = {"message": repr(exc)}
    finally:
        out.ended = time.monotonic()


def _error_of(body: bytes) -> dict[str, Any] | None:
    """The OpenAI error object of a response body, or None when the body is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err:
        return err
    return None


def metric_of(base: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One router series summed over matching labels (0.0 when absent)."""
    from pdserve.tests.harness.cluster_fixture import sample

    return sample(httpx2.get(f"{base}/metrics", timeout=10).text, name, labels)
