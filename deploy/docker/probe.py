#!/usr/bin/env python3
"""`pdserve-probe health | drain`: the container's health check and a node's pre-stop drain.

Standard library only for `health`, so it starts in milliseconds beside a loaded engine; `drain` signs its
calls to the node with pdserve's own signing module (shared/node/node_sign.py). Which component runs, and on
which address, is read from the container's main process (PID 1's command line: `pdserve router ...`
or, after its exec, `python -m pdserve.prefill_node ...`), then from PDSERVE_HOST / PDSERVE_PORT, unless
--role, --host and --port say it. `drain` tells a node to take no new work (POST /internal/drain, unless
its health already says draining), then waits until its engine holds no request (GET /internal/audit:
live_requests == 0) or --timeout passes.
Exit codes: 0 healthy / drained; 1 not healthy, not drained in time, or the node unreachable.

It is an entry point of its own (the image's HEALTHCHECK and the nodes' preStop hook run it as a process),
so, like the CLI's settings (docs/architecture.md, "The environment"), it reads the pod's PDSERVE_HOST,
PDSERVE_PORT and PDSERVE_AUTH_TOKEN(_FILE): in `main` only, and hands the values on as arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

ROUTER_MARKERS = ("router", "pdserve.router")
DEFAULT_PORTS = {"router": 8000, "node": 8100}


@dataclass(frozen=True)
class Target:
    role: str  # "router" or "node"
    base: str  # http://host:port
    token: str | None  # the cluster's credential: node calls are signed with a key derived from it


def _main_argv() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _token(env: Mapping[str, str]) -> str | None:
    path = env.get("PDSERVE_AUTH_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    return env.get("PDSERVE_AUTH_TOKEN") or None


def target(args: argparse.Namespace, env: Mapping[str, str]) -> Target:
    """What to probe: --role/--host/--port, else PID 1's flags, else `env`'s PDSERVE_HOST / PDSERVE_PORT."""
    argv = _main_argv()
    role = args.role or ("router" if any(a in ROUTER_MARKERS for a in argv[:3]) else "node")
    host = args.host or _flag(argv, "--host") or env.get("PDSERVE_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    port = args.port or _flag(argv, "--port") or env.get("PDSERVE_PORT") or DEFAULT_PORTS[role]
    return Target(role, f"http://{host}:{port}", _token(env))


def _call(t: Target, method: str, path: str, timeout_s: float) -> tuple[int, dict[str, object]]:
    body = b"{}" if method == "POST" else None
    req = urllib.request.Request(t.base + path, method=method, data=body)
    req.add_header("Content-Type", "application/json")
    if t.token and t.role == "node" and path != "/internal/health":
        # Imported here: only a drain signs (with a key derived from the token, which never travels); the
        # health check stays on the standard library.
        from pdserve.shared.node.node_sign import ClusterKeys

        req.add_header("Authorization", ClusterKeys(t.token).sign_request(method, path.encode(), body or b""))
    with urllib.request.urlopen(req, timeout=timeout_s) as reply:
        body = reply.read()
        return reply.status, json.loads(body) if body else {}


def health(t: Target, timeout_s: float) -> int:
    path = "/health" if t.role == "router" else "/internal/health"
    try:
        status, _ = _call(t, "GET", path, timeout_s)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"pdserve-probe: {t.base}{path} failed: {exc}", file=sys.stderr)
        return 1
    return 0 if status == 200 else 1


def drain(t: Target, timeout_s: float, poll_s: float) -> int:
    if t.role != "node":
        print(
            "pdserve-probe: drain applies to prefill, decode and single nodes, not the router",
            file=sys.stderr,
        )
        return 1
    deadline = time.monotonic() + timeout_s
    try:
        _, state = _call(t, "GET", "/internal/health", 10.0)
        if not state.get("draining"):  # drained already (kvctl drain): a second POST would fail
            _call(t, "POST", "/internal/drain", 10.0)
        while True:
            _, audit = _call(t, "GET", "/internal/audit", max(1.0, deadline - time.monotonic()))
            live = audit.get("live_requests")
            if live == 0:
                print(f"pdserve-probe: {t.base} drained", file=sys.stderr)
                return 0
            if time.monotonic() >= deadline:
                msg = f"pdserve-probe: {t.base} still holds {live} request(s) after {timeout_s:.0f}s"
                print(msg, file=sys.stderr)
                return 1
            time.sleep(poll_s)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"pdserve-probe: drain of {t.base} failed: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve-probe", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["health", "drain"])
    p.add_argument("--role", choices=["router", "node"], help="default: read from PID 1's command line")
    p.add_argument("--host", help="default: PID 1's --host, then PDSERVE_HOST, then 127.0.0.1")
    p.add_argument("--port", type=int, help="default: PID 1's --port, then PDSERVE_PORT, then 8000 / 8100")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds: a health call; a whole drain")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between a draining node's audits")
    args = p.parse_args(argv)
    t = target(args, os.environ)
    if args.action == "health":
        return health(t, args.timeout)
    return drain(t, args.timeout, args.poll)


if __name__ == "__main__":
    sys.exit(main())
