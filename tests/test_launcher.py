"""`pdserve up` as a person runs it, as one process: its children die with it (SIGHUP like Ctrl-C; a
SIGKILLed launcher leaves nothing within 5 s), a port in use fails at once in one line, a node killed is
started again while the router keeps answering, Redis asks for a password nobody sees on argv, the nodes'
environment holds no API key, and the cluster file lets `kvctl` with no flags find the cluster. One
cluster serves the module's tests (CI time); it ends killed with SIGKILL. kvctl's imports stay torch-free.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest
import redis
from pdserve.cli.redis_launch import free_port
from pdserve.tests.harness.cluster_fixture import assert_not_on_any_command_line, model_path

pytestmark = pytest.mark.slow

API_KEY = "launcher-test-key-5e2a"
TEMPLATE = (  # SmolLM2's, without the default system message it adds
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _env(rundir: Path, **extra: str) -> dict[str, str]:
    """The environment of a person's shell: no PDSERVE_* setting, a runtime dir of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return env | {"XDG_RUNTIME_DIR": str(rundir), **extra}


@dataclass
class Up:
    """A running `pdserve up` process, its output read by a thread, and the table it printed."""

    proc: subprocess.Popen[str]
    rundir: Path
    lines: list[str] = field(default_factory=list)
    table: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """component -> (pid, url, log file)"""

    @staticmethod
    def start(rundir: Path, *args: str, env: dict[str, str] | None = None) -> Up:
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--threads", "1", "--model", model_path(), *args]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env(rundir)
        )
        up = Up(proc, rundir)
        threading.Thread(target=up._read, daemon=True).start()
        try:
            up.wait_line("Ctrl-C stops every process", 300)
        except BaseException:
            proc.kill()
            raise
        for line in up.lines:
            cells = line.split()
            if line.startswith("  ") and len(cells) == 5 and cells[2].isdigit():
                up.table[cells[0]] = (int(cells[2]), cells[3], cells[4])
        return up

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str, timeout_s: float, start: int = 0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.lines[start:] if text in line]
            if found:
                return found[0]
            assert self.proc.poll() is None or found, f"pdserve up exited: {self.lines[-20:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s:.0f}s: {self.lines[-20:]}"
            time.sleep(0.2)

    def kill_left(self) -> None:
        """The launcher and what it left running, killed by pid (after a failed test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _kill_left(self.pids)

    @property
    def pids(self) -> list[int]:
        return [pid for pid, _, _ in self.table.values()]

    def cluster_file(self) -> dict[str, object]:
        files = list((self.rundir / "pdserve").glob("*.json"))
        assert len(files) == 1, files
        data: dict[str, object] = json.loads(files[0].read_text())
        return data


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone_within(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while [p for p in pids if _alive(p)]:
        left = [p for p in pids if _alive(p)]
        assert time.monotonic() < deadline, f"still running {seconds:.0f}s after the launcher: {left}"
        time.sleep(0.1)


def _kill_left(pids: list[int]) -> None:
    """What a failed test left running (a launcher that orphaned its children) is killed by pid."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def kvctl(rundir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real kvctl with no --redis, no credential flag: only the cluster file `pdserve up` left."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.kvctl.cli", *args], env=_env(rundir), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def _chat(base: str) -> httpx2.Response:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {API_KEY}"}
    return httpx2.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    rundir = tmp_path_factory.mktemp("run")
    rundir.chmod(0o700)
    env = _env(rundir, PDSERVE_API_KEYS=API_KEY)
    template = rundir / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ("--port", str(free_port()), "--served-model-name", "smol", "--chat-template", str(template))
    started = Up.start(rundir, *args, env=env)
    yield started
    if started.proc.poll() is None:
        started.proc.send_signal(signal.SIGINT)
        started.proc.wait(60)
    started.kill_left()


def test_port_in_use_fails_at_once_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--model", model_path()],
            env=_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode != 0
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and f"port {port}" in errors[0] and "in use" in errors[0], done.stderr
    assert "starting Redis" not in done.stdout, "it started the cluster before checking the port"


def test_a_bad_node_id_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--node-id", "decode/0", "--port", "1",
         "--model", model_path()],
        env=_env(tmp_path, PDSERVE_AUTH_TOKEN="t" * 16), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode != 0
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and "--node-id" in errors[0] and "decode/0" in errors[0], done.stderr


def test_kvctl_help_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pdserve.kvctl.cli", "--help"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "pdserve.kvctl" in imported and "click" in imported
    assert not {"torch", "transformers"} & imported


def test_kvctl_picks_a_cluster_by_name_while_several_run(tmp_path: Path) -> None:
    """Two cluster files of running launchers (this process stands in for both): kvctl asks for --cluster,
    then uses the one named; a file whose launcher is gone is ignored."""
    (tmp_path / "pdserve").mkdir()
    (tmp_path / "t").write_text("the-cluster-token")  # every kvctl command verifies records with it
    ports = {"a": free_port(), "b": free_port(), "gone": free_port()}
    for name, port in ports.items():
        pid = os.getpid() if name != "gone" else 2**22 + 1  # above pid_max's default: never running
        record = {"name": name, "pid": pid, "redis_url": f"redis://127.0.0.1:{port}/0", "redis_password": "p",
                  "router_url": "http://127.0.0.1:1", "auth_token_file": str(tmp_path / "t")}  # fmt: skip
        (tmp_path / "pdserve" / f"{name}.json").write_text(json.dumps(record))
    several = kvctl(tmp_path, "nodes")
    assert several.returncode == 2 and "several `pdserve up` clusters run (a, b)" in several.stderr
    picked = kvctl(tmp_path, "nodes", "--cluster", "b")
    assert picked.returncode == 1 and f"127.0.0.1:{ports['b']}" in picked.stderr, picked.stderr
    gone = kvctl(tmp_path, "nodes", "--cluster", "gone")
    assert gone.returncode == 2 and "no running `pdserve up` cluster 'gone'" in gone.stderr, gone.stderr


def test_the_cluster_file_names_a_redis_with_a_password(up: Up) -> None:
    files = list((up.rundir / "pdserve").glob("*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    record = up.cluster_file()
    password = str(record["redis_password"])
    assert len(password) >= 16
    assert_not_on_any_command_line(password)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(str(record["redis_url"])).ping()
    assert redis.Redis.from_url(str(record["redis_url"]), password=password).ping()
    assert Path(str(record["auth_token_file"])).read_text()
    assert _chat(str(record["router_url"])).status_code == 200


def test_the_router_and_the_nodes_render_the_chat_template_given(up: Up) -> None:
    """The nodes got it too, or their tokenizer fingerprints would differ from the router's and it would
    have refused them (the cluster would not have started)."""
    from pdserve.shared.model.tokenizer import Tokenizer

    usage = _chat(str(up.cluster_file()["router_url"])).json()["usage"]
    rendered = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    assert usage["prompt_tokens"] == len(Tokenizer.from_gguf(model_path()).encode(rendered))


def test_nodes_carry_only_their_own_secrets(up: Up) -> None:
    for name, (pid, _, _) in up.table.items():
        if name == "redis":
            continue
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert b"PDSERVE_AUTH_TOKEN" in env and b"PDSERVE_REDIS_PASSWORD" in env, name
        assert (b"PDSERVE_API_KEYS" in env) == (name == "router"), name


def test_node_logs_hold_no_progress_bar(up: Up) -> None:
    for name, (_, _, log) in up.table.items():
        if name.startswith(("prefill", "decode")):
            text = Path(log).read_text(errors="replace")
            assert "\r" not in text and "loaded" in text, (name, text[-2000:])


def test_kvctl_finds_the_cluster_with_no_flags(up: Up) -> None:
    done = kvctl(up.rundir, "nodes", "--json")
    assert done.returncode == 0, done.stderr
    assert sorted(n["info"]["node_id"] for n in json.loads(done.stdout)["nodes"]) == ["decode-0", "prefill-0"]
    assert "kvctl --cluster" in "\n".join(up.lines) or "kvctl nodes" in "\n".join(up.lines)
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pdserve.kvctl.cli", "where", "--prompt", "hi", "--json"],
        env=_env(up.rundir), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert imports.returncode == 0, imports.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in imports.stderr.splitlines() if "|" in line}
    assert "torch" not in imported  # (transformers still converts the GGUF's tokenizer)


def test_undrain_without_url_after_the_node_left(up: Up) -> None:
    assert kvctl(up.rundir, "drain", "prefill-0").returncode == 0
    deadline = time.monotonic() + 60
    while "prefill-0" in kvctl(up.rundir, "nodes", "--json").stdout:
        assert time.monotonic() < deadline, "the drained, idle prefill node did not leave the index"
        time.sleep(0.5)
    done = kvctl(up.rundir, "undrain", "prefill-0", "--json")
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 60
    while "prefill-0" not in kvctl(up.rundir, "nodes", "--json").stdout:
        assert time.monotonic() < deadline, "prefill-0 is not back in the index"
        time.sleep(0.5)


def test_a_killed_node_is_started_again_while_the_router_answers(up: Up) -> None:
    pid, url, _ = up.table["prefill-0"]
    seen = len(up.lines)
    os.kill(pid, signal.SIGKILL)
    base = str(up.cluster_file()["router_url"])
    for _ in range(4):
        reply = _chat(base)
        assert reply.status_code == 200, reply.text
    up.wait_line("prefill-0 exited", 30, seen)
    up.wait_line("prefill-0 is back", 300, seen)
    assert up.proc.poll() is None
    health = httpx2.get(f"{url}/internal/health", timeout=10)
    assert health.status_code == 200
    assert _chat(base).status_code == 200


def test_a_sigkilled_launcher_leaves_nothing_running(up: Up) -> None:
    """Last in the module: it ends the shared cluster."""
    pids = list(up.pids)
    new_prefill = [int(line.split("pid ")[1].split(")")[0]) for line in up.lines if "is back (pid" in line]
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait(10)
    try:
        assert_gone_within(pids + new_prefill, 5.0)
    finally:
        _kill_left(pids + new_prefill)


def test_sighup_stops_the_cluster_and_removes_its_files(tmp_path: Path) -> None:
    """Also what `pdserve up` shows (issue 17, defect 6): the Redis URL, a table of its processes (role, pid,
    URL, log) and how kvctl reaches the cluster, which it then does with no flag."""
    port = free_port()
    up = Up.start(tmp_path, "--port", str(port), "--prefill", "0", "--decode", "1",
                  "--node-args", "--kv-cache-gib 0.125")  # fmt: skip
    try:
        text = "\n".join(up.lines)
        assert set(up.table) == {"redis", "single-0", "router"}, text
        redis_url = str(up.cluster_file()["redis_url"])
        assert f"Redis at {redis_url}" in text and up.table["redis"][1] == redis_url, text
        assert up.table["router"][1] == f"http://127.0.0.1:{port}", text
        assert "kvctl nodes" in text and all(os.path.exists(up.table[n][2]) for n in ("single-0", "router"))
        listed = kvctl(tmp_path, "nodes", "--json")
        assert [n["info"]["node_id"] for n in json.loads(listed.stdout)["nodes"]] == ["single-0"], listed
        pipe = f"{sys.executable} -m pdserve.kvctl.cli nodes --json | head -1"
        piped = subprocess.run(["bash", "-c", pipe], env=_env(tmp_path), capture_output=True, text=True,
                               timeout=120, check=False)  # fmt: skip
        assert piped.stdout.strip() and "Traceback" not in piped.stderr, piped.stderr
        body = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Ports:", "max_tokens": 4}
        assert (
            httpx2.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).status_code == 200
        )
        router_log = Path(up.table["router"][2]).read_text()
        assert '"POST /v1/completions HTTP/1.1" 200' in router_log, router_log[-2000:]
        workdir = Path(next(line for line in up.lines if "logs in" in line).split("logs in ")[1])
        assert (workdir / "auth-token").exists()
        up.proc.send_signal(signal.SIGHUP)
        assert_gone_within(up.pids, 5.0)
        assert up.proc.wait(10) == 0
    finally:
        up.kill_left()
    assert not workdir.exists(), "the work directory (and its auth-token) outlived the cluster"
    assert not list((tmp_path / "pdserve").glob("*.json")), "the cluster file outlived the cluster"
