"""KV transfer between two GPUs of one host: raw links against the connectors, in one table.

A program, not a test: `python benchmarks/kv_transfer.py [--out results.json]` on a machine with two GPUs.
It measures, in this process, the raw GPU0 -> GPU1 copy (`Tensor.copy_` across devices), then starts D
(`kv_transfer_peers.py recv`, GPU1), one D per GPU kind (nccl, cuda_ipc, ucx) that kills itself at its first
DATA (`victim`, GPU1), and P (`send`, GPU0), which times raw NCCL send/recv and raw ucxx send/recv (each
message answered by a 1-byte ack) and every connector (nccl, cuda_ipc, ucx, tcp) moving 512 MiB as one frame
into a sink, and the KV of a 4096-token prompt of the Llama-3.1-8B shape between paged caches: per layer
(gather kernel -> frame -> scatter kernel), one chunk (32 gathers, one frame, 32 scatters) and one frame per
block. Connector bandwidth = payload / (first DATA send -> D's ACK); `wall` adds the gathers. D checks every
paged transfer bit for bit, and both ends audit what is left (blocks, open transfers, pair groups, IPC
windows, GPU memory).
Targets (issue 6): each connector >= 90 % of its library's raw send/recv (cuda_ipc's library is the copy
itself); the best >= 90 % of the raw copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
SIZES = [512 * MIB, 16 * MIB]
PEERS = str(Path(__file__).with_name("kv_transfer_peers.py"))


def raw_copy(size: int, reps: int = 10) -> dict[str, Any]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    times = []
    for rep in range(reps + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)
        if rep >= 2:
            times.append(time.perf_counter() - t0)
    assert torch.equal(dst[:1024].cpu(), src[:1024].cpu())
    med = statistics.median(times)
    every = [round(t * 1e3, 4) for t in times]
    return {
        "path": "raw copy GPU0->GPU1",
        "size": size,
        "gib_s": size / med / 2**30,
        "median_ms": med * 1e3,
        "ms": every,
    }


def start(role: str, device: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, PEERS, role, device, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def read_line(proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(kind + " "):
            return dict(json.loads(line[len(kind) + 1 :]))
        print(line, end="", file=sys.stderr)
    raise RuntimeError(f"peer exited (rc={proc.wait()}) before printing {kind}")


def _pct(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    return f"{100 * row['gib_s'] / ref['gib_s']:.0f} %" if ref and row["size"] == ref["size"] else ""


def table(rows: list[dict[str, Any]]) -> str:
    raw = {r["path"]: r for r in rows if r["path"].startswith("raw") and r["size"] == 512 * MIB}
    own = {"nccl": "raw nccl send/recv", "ucx": "raw ucxx send/recv", "cuda_ipc": "raw copy GPU0->GPU1"}
    out = [
        "| path | size | GiB/s | median ms | wall GiB/s | vs own raw | vs raw copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "gib_s" not in r:
            continue
        kind = r["path"].split()[1].rstrip(":") if r["path"].startswith("connector") else ""
        wall = f"{r['wall_gib_s']:.1f}" if "wall_gib_s" in r else ""
        out.append(
            f"| {r['path']} | {r['size'] // MIB} MiB | {r['gib_s']:.1f} | {r['median_ms']:.3f} | {wall} | "
            f"{_pct(r, raw.get(own.get(kind, '')))} | {_pct(r, raw.get('raw copy GPU0->GPU1'))} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write every figure and audit as JSON here")
    p.add_argument(
        "--connectors",
        default="nccl,cuda_ipc,ucx,tcp",
        help="comma-separated connector kinds to measure (the raw rows always run)",
    )
    args = p.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    rows: list[dict[str, Any]] = [raw_copy(size) for size in SIZES]
    kinds = args.connectors.split(",")
    recv = start("recv", "cuda:1", args.connectors)
    victims = {kind: start("victim", "cuda:1", kind) for kind in ("nccl", "cuda_ipc", "ucx") if kind in kinds}
    extra: dict[str, Any] = {}
    overlaps: list[dict[str, Any]] = []
    try:
        ready = read_line(recv, "READY")
        victims_ready = {kind: read_line(proc, "READY") for kind, proc in victims.items()}
        send = start("send", "cuda:0", json.dumps(ready), json.dumps(victims_ready))
        assert send.stdout is not None
        for line in send.stdout:
            kind, _, body = line.partition(" ")
            if kind == "RESULT":
                rows.append(json.loads(body))
            elif kind == "OVERLAP":
                overlaps.append(json.loads(body))
            elif kind == "SENDER_AUDIT":
                extra["sender_audit"] = json.loads(body)
            else:
                print(line, end="", file=sys.stderr)
        extra["sender_rc"] = send.wait()
        assert recv.stdin is not None
        recv.stdin.close()
        extra["receiver_audit"] = read_line(recv, "AUDIT")
        extra["receiver_rc"] = recv.wait(timeout=60)
    finally:
        for proc in (recv, *victims.values()):
            if proc.poll() is None:
                proc.kill()
        extra["victim_rc"] = {kind: proc.wait() for kind, proc in victims.items()}
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"# KV transfer, {when}, {platform.node()}, {gpus}, torch {torch.__version__}")
    print(table(rows))
    print("\n| prefill-like run (GPU0) | compute ms | compute + transfer to ACK ms | exposed transfer ms |")
    print("|---|---|---|---|")
    for o in overlaps:
        print(
            f"| {o['path']} | {o['compute_ms']:.2f} | {o['total_ms']:.2f} | {o['exposed_transfer_ms']:.2f} |"
        )
    for r in rows:
        if "gib_s" not in r:
            print(json.dumps(r))
    print(json.dumps(extra, indent=1))
    if args.out:
        record = {"when": when, "gpus": gpus, "rows": rows, "overlap": overlaps, **extra}
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
