"""A throwaway local redis-server on a free port, for `pdserve up`, tests and benchmarks.

Invariants: the server keeps nothing on disk (`--save '' --appendonly no`, its dir is a temporary
directory removed on stop); `stop()` ends exactly the process it started, by pid, and is idempotent.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalRedis:
    """Start with `start()` (or as a context manager); `url` points at it."""

    binary: str = "/usr/bin/redis-server"
    port: int = 0
    password: str | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 10.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _dir: str | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> LocalRedis:
        if self._proc is not None:
            raise RuntimeError(f"redis-server already started (pid {self._proc.pid})")
        self.port = self.port or free_port()
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(
            [*args, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server on port {self.port} did not accept connections in {self.startup_timeout_s}s"
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
            if proc.stderr is not None:
                proc.stderr.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
