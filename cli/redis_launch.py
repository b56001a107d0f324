"""A throwaway local redis-server on a free port, for `pdserve up`, tests and benchmarks.

Invariants: the server keeps nothing on disk (`--save '' --appendonly no`, its dir and its log are in a
temporary directory removed on stop), unless `aof_dir` is given: then it keeps an append-only file there
(fsync every second) that a server started later on the same directory loads, and that directory outlives
stop(); `start()` returns only once that process itself answers PING (with an AOF, once it has loaded it);
`stop()` ends exactly the process it started, by pid, and is idempotent. With `die_with_parent` the server
gets SIGKILL from the kernel when the thread that started it ends (Linux's parent-death signal), so a
launcher killed outright leaves no Redis behind.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_LOWEST_PORT = 10000
_handed_out: set[int] = set()
_rng = random.SystemRandom()  # independent of any seed a caller set on the random module


def _lowest_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server that binds it later.

    Chosen at random below the kernel's ephemeral range: a port from that range (what binding port 0 gives)
    can be taken by any outgoing connection before the server, often a process still importing torch,
    binds it. Never the same port twice in one process, so two servers started together do not collide.
    """
    low = _lowest_ephemeral_port()
    tries = 100 if low - _LOWEST_PORT >= 1000 else 0
    for _ in range(tries):
        port = _rng.randrange(_LOWEST_PORT, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for a child of this process: the kernel sends it SIGKILL when the thread that started
    it ends, and it exits at once if this process is already gone (it died between fork and prctl). Linux
    only (prctl); elsewhere the hook does nothing."""
    parent = os.getpid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # looked up before the fork

    def hook() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

    return hook


class _BindRace(RuntimeError):
    """redis-server could not bind its port: something took it after free_port() saw it free."""


@dataclass
class LocalRedis:
    """Start with `start()` (or as a context manager); `url` points at it. With a TLS certificate and
    key it serves TLS only (the certificate is its own CA; clients are not asked for certificates)."""

    binary: str = "/usr/bin/redis-server"
    port: int = 0
    password: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    startup_timeout_s: float = 10.0
    aof_dir: str | None = None
    """Keep an append-only file in this directory (created if missing; kept after stop), loaded at start."""
    die_with_parent: bool = False
    """The server is killed when the thread that started it ends (a launcher killed with SIGKILL)."""
    extra_args: tuple[str, ...] = ()
    """More redis-server flags (e.g. `--replicaof HOST PORT` for a replica)."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _dir: str | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls_cert_file else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> str | None:
        """The server's log file while it runs (removed with its directory on stop)."""
        return None if self._dir is None else os.path.join(self._dir, "redis.log")

    @property
    def running(self) -> bool:
        """Whether the process start() started is still running."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedis:
        """Starts the server; when the port was left to it (0) and another socket takes the free port
        before redis-server binds it, it tries again on a fresh port (3 tries)."""
        if self._proc is not None:
            raise RuntimeError(f"redis-server already started (pid {self._proc.pid})")
        chosen = self.port
        for attempt in range(3):
            self.port = chosen or free_port()
            try:
                return self._start_once()
            except _BindRace:
                if chosen or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> LocalRedis:
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        persist = ["--appendonly", "no", "--dir", self._dir]
        if self.aof_dir is not None:
            os.makedirs(self.aof_dir, mode=0o700, exist_ok=True)
            persist = ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", self.aof_dir]
        listen = ["--port", str(self.port)]
        if self.tls_cert_file is not None:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls_cert_file]
            listen += ["--tls-key-file", self.tls_key_file or "", "--tls-ca-cert-file", self.tls_cert_file]
            listen += ["--tls-auth-clients", "no"]
        conf = os.path.join(self._dir, "redis.conf")  # the password in a 0600 file: argv is public (ps)
        with open(os.open(conf, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("" if self.password is None else f'requirepass "{self.password}"\n')
        args = [self.binary, conf, *listen, "--bind", "127.0.0.1", "--save", ""]
        args += [*persist, "--daemonize", "no", "--loglevel", "warning", *self.extra_args]
        assert self.log_path is not None
        with open(self.log_path, "wb") as log:
            hook = die_with_parent() if self.die_with_parent else None
            self._proc = subprocess.Popen(args, stdout=log, stderr=log, preexec_fn=hook)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._log_tail()
                self.stop()
                message = f"redis-server on port {self.port} exited at start: {err.strip()}"
                raise (_BindRace if "already in use" in err else RuntimeError)(message)
            if self._answers_ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server on port {self.port} did not accept connections in {self.startup_timeout_s}s"
        )

    def _log_tail(self) -> str:
        assert self._dir is not None
        try:
            with open(os.path.join(self._dir, "redis.log"), errors="replace") as f:
                return " | ".join(line.strip() for line in f.readlines()[-3:])
        except OSError:
            return ""

    def _answers_ping(self) -> bool:
        """True once a Redis answers PING on the port (another listener there does not count)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                conn = raw
                if self.tls_cert_file is not None:
                    context = ssl.create_default_context(cafile=self.tls_cert_file)
                    context.check_hostname = False
                    conn = context.wrap_socket(raw)
                conn.sendall(b"PING\r\n")
                reply = conn.recv(64)
        except OSError:
            return False
        return (
            reply.startswith((b"+PONG", b"-NOAUTH")) and self._proc is not None and self._proc.poll() is None
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
