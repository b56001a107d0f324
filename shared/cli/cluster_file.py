"""The cluster file: what `pdserve up` leaves for `kvctl` so that kvctl needs no flags.

`pdserve up` writes `<dir>/<name>.json` (mode 0600; `<dir>` is `$XDG_RUNTIME_DIR/pdserve`, else
`~/.cache/pdserve`) once the cluster serves, and removes it on exit. It names the Redis URL and its
password, the router's URL, the file holding the cluster's credential and each node's URL (so that kvctl
reaches a node that left the index). Invariants: a file whose launcher pid is no longer running is stale
and ignored (a launcher killed outright cannot remove it); the password is in the file, never on argv;
the caller passes the environment (entry points read it), this module reads no variable itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from pdserve.shared.cli.settings import SettingsError


@dataclass(frozen=True)
class ClusterFile:
    name: str
    pid: int
    """The `pdserve up` process."""
    redis_url: str
    redis_password: str
    router_url: str
    auth_token_file: str
    index_cluster: str = "default"
    """The key prefix of the cluster in Redis (kvctl's --cluster with --redis)."""
    nodes: dict[str, str] = field(default_factory=dict)
    """node id -> its internal HTTP URL."""


def cluster_dir(environ: Mapping[str, str]) -> str:
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "pdserve")
    return os.path.join(os.path.expanduser("~"), ".cache", "pdserve")


def path_of(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.json")


def write(directory: str, record: ClusterFile) -> str:
    """Writes the file (0600, replaced atomically); returns its path."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = path_of(directory, record.name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        json.dump(asdict(record), f, indent=2)
    os.replace(tmp, path)
    return path


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live(directory: str) -> dict[str, ClusterFile]:
    """The cluster files of running launchers, by name (unreadable or stale files are skipped)."""
    found: dict[str, ClusterFile] = {}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return found
    for entry in names:
        if not entry.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, entry), encoding="utf-8") as f:
                record = ClusterFile(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        if _running(record.pid):
            found[record.name] = record
    return found


def find(directory: str, name: str | None) -> ClusterFile | None:
    """The running cluster `name`, or the only one running when name is None (None: none runs).
    SettingsError when `name` is not running or several run and none was named."""
    running = live(directory)
    if name is not None:
        if name not in running:
            known = ", ".join(running) or "none"
            raise SettingsError(f"no running `pdserve up` cluster {name!r} in {directory} (running: {known})")
        return running[name]
    if len(running) > 1:
        raise SettingsError(
            f"several `pdserve up` clusters run ({', '.join(running)}): pick one with --cluster NAME"
        )
    return next(iter(running.values()), None)
