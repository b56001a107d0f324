"""Tensor parallelism on the CPU (gloo), through the real `pdserve generate` in subprocesses: TP=N gives
TP=1's greedy tokens (SmolLM2: 9 query heads, 3 KV heads, split at TP=3; a tiny Llama made with Hugging
Face's own classes, 4 query heads and 2 KV heads, replicated at TP=4), a split that is not exact is refused
with one line, and a rank killed with SIGKILL takes the other ranks down. The sharding arithmetic and the
step message are checked without processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pdserve.shared.engine.model_runner import BatchItem
from pdserve.shared.engine.parallel.step_channel import pack, unpack
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.model.parallel import SingleRank, check_split, plan
from pdserve.tests.harness.cluster_fixture import model_path
from pdserve.tests.harness.tiny_models import TINY

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"prompt": "def fibonacci(n):\n    "},
    {"prompt": "The three primary colors are"},
]
MAX_NEW = 24


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


def _tokens(*args: str) -> list[list[int]]:
    proc = _generate(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line)["token_ids"] for line in proc.stdout.splitlines()]


def _prompts_file(path: Path) -> str:
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


def test_smollm2_tp3_gives_tp1_greedy_tokens(tmp_path: Path) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    args = ("--prompts-file", prompts, "--max-tokens", str(MAX_NEW), "--kv-cache-gib", "0.05")
    tp1, tp3 = _tokens(*args), _tokens(*args, "--tensor-parallel-size", "3")
    assert len(tp1) == len(PROMPTS) and all(len(t) > 0 for t in tp1)
    assert tp3 == tp1


def test_smollm2_tp2_is_refused_in_one_line() -> None:
    proc = _generate("--prompt", "hi", "-tp", "2")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "tensor_parallel_size=2" in lines[0] and "9 query heads" in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded 2-layer Llama (4 query heads, 2 KV heads, biases, untied head, a vocabulary that 4 does not
    divide) saved by Hugging Face's own classes as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = TINY | {"vocab_size": 49155, "intermediate_size": 128, "head_dim": 16, "attention_bias": True,
                   "rms_norm_eps": 1e-6}  # fmt: skip
    config = LlamaConfig(**tiny)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def test_tiny_llama_tp4_replicates_kv_heads_and_gives_tp1_greedy_tokens(
    tiny_llama: str, tmp_path: Path
) -> None:
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    args = ("--model", tiny_llama, "--tokenizer", model_path(), "--prompts-file", prompts,
            "--max-tokens", str(MAX_NEW), "--ignore-eos", "--kv-cache-gib", "0.01")  # fmt: skip
    # TP=4 with async scheduling: the workers' placeholders come from rank 0's broadcast sampled tokens
    tp1, tp4 = _tokens(*args), _tokens(*args, "--tensor-parallel-size", "4", "--async-scheduling", "on")
    assert all(len(t) == MAX_NEW for t in tp1)
    assert tp4 == tp1


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _sockets(pid: int) -> int:
    fd_dir = f"/proc/{pid}/fd"
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            count += os.readlink(f"{fd_dir}/{fd}").startswith("socket:")
        except FileNotFoundError:
            continue
    return count


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"  # a zombie has exited (its parent reaps it)
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], limit_s: float) -> float:
    """Seconds until every pid has exited; fails past `limit_s`."""
    start = time.monotonic()
    while not all(_gone(p) for p in pids):
        assert time.monotonic() - start < limit_s, f"still running after {limit_s} s: {pids}"
        time.sleep(0.05)
    return time.monotonic() - start


def _start_long_tp3(err: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """`pdserve generate -tp 3` decoding a long answer (stderr to `err`), once both workers have joined the
    group (each then holds sockets to its peers beyond the store's)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--threads", "1", "-tp", "3", "--prompt",
           "Once upon", "--max-tokens", "2000", "--ignore-eos", "--kv-cache-gib", "0.05"]  # fmt: skip
    with err.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    workers: list[int] = []
    while len(workers) < 2 or min(_sockets(w) for w in workers) < 3:
        assert proc.poll() is None, err.read_text()[-2000:]
        assert time.monotonic() < deadline, "the workers never joined"
        workers = _children(proc.pid)
        time.sleep(0.2)
    time.sleep(3.0)  # into the decode loop
    return proc, workers


def test_killed_worker_takes_the_engine_down(tmp_path: Path) -> None:
    proc, workers = _start_long_tp3(tmp_path / "stderr")
    os.kill(workers[1], signal.SIGKILL)
    others = _wait_gone([workers[0]], 5.0)
    rank0 = _wait_gone([proc.pid], 30.0)
    print(f"after SIGKILL of rank 2: rank 1 gone in {others:.2f} s, rank 0 in {rank0:.2f} s")
    assert proc.wait() != 0
    last = (tmp_path / "stderr").read_text().strip().splitlines()[-1]
    assert last.startswith("pdserve: error:") and "the engine is down" in last, last


def test_killed_rank0_takes_the_workers_down(tmp_path: Path) -> None:
    proc, workers = _start_long_tp3(tmp_path / "stderr")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"after SIGKILL of rank 0: workers gone in {_wait_gone(workers, 5.0):.2f} s")


def test_plan_splits_or_replicates_kv_heads() -> None:
    smol = NAMED_SHAPES["smollm2-135m"]  # 9 query heads, 3 KV heads
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in (plan(smol, r, 3) for r in range(3))] == [
        (3, 1, 0),
        (3, 1, 1),
        (3, 1, 2),
    ]
    tiny = NAMED_SHAPES["smollm2-135m"].__class__.from_dict(
        smol.to_dict() | {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64}
    )
    # 4 ranks, one query head each; query heads 0-1 use KV head 0, heads 2-3 use KV head 1
    assert [plan(tiny, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 9 query heads"):
        check_split(smol, 2)
    six = smol.__class__.from_dict(smol.to_dict() | {"num_heads": 6, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the model's 3 KV heads"):
        check_split(six, 2)


def test_dummy_weights_are_one_model_at_any_size() -> None:
    cfg = NAMED_SHAPES["smollm2-135m"].__class__.from_dict(
        NAMED_SHAPES["smollm2-135m"].to_dict() | {"num_layers": 1, "vocab_size": 1000}
    )
    cpu = torch.device("cpu")
    whole = LlamaModel(cfg, cpu, torch.float32)
    fill_dummy_weights(whole, seed=7)
    p = plan(cfg, 2, 3)
    part = LlamaModel(cfg, cpu, torch.float32, p, _RankTwo())
    fill_dummy_weights(part, seed=7)
    d, q, f = cfg.head_dim, cfg.num_heads * cfg.head_dim, p.intermediate_size
    w, s = whole.decoder_layers[0], part.decoder_layers[0]
    assert torch.equal(s.qkv_weight[: 3 * d], w.qkv_weight[6 * d : 9 * d])  # query heads 6..8
    assert torch.equal(s.qkv_weight[3 * d : 4 * d], w.qkv_weight[q + 2 * d : q + 3 * d])  # K head 2
    assert torch.equal(s.gate_up_weight[f:], w.gate_up_weight[cfg.intermediate_size + 2 * f :])  # up rows
    assert torch.equal(s.down_weight, w.down_weight[:, 2 * f :])
    assert torch.equal(part.embed_weight[:332], whole.embed_weight[668:])  # rows 668..999 of 334, padded
    assert not part.embed_weight[332:].any()


class _RankTwo(SingleRank):
    rank, size = 2, 3


def test_step_message_round_trip() -> None:
    items = [
        BatchItem(list(range(40)), 32, 8, [5, 9, 2], True),
        BatchItem([7, 8, 9], 2, 1, [4], False),
    ]
    on_device = BatchItem([7, 8, 9], 3, 1, [4], True, prev_row=1)  # async scheduling: its token is a tensor's
    assert unpack(pack(items).tobytes()).argmax is False
    step = unpack(pack([*items, on_device], argmax=True).tobytes())
    got = step.items
    assert step.argmax  # a greedy step: every rank ends it in the tokens' all-gather
    for a, b in zip([*items, on_device], got, strict=True):
        assert (a.start, a.num_tokens, list(a.block_ids), a.sample, a.prev_row) == (
            b.start, b.num_tokens, b.block_ids, b.sample, b.prev_row,
        )  # fmt: skip
    for a, b in zip(items, got[:2], strict=True):
        assert list(b.token_ids[b.start : b.start + b.num_tokens]) == list(
            a.token_ids[a.start : a.start + a.num_tokens]
        )


def test_a_node_refuses_a_split_that_is_not_exact_in_one_line() -> None:
    """Nodes serve at any exact size (tests/test_serving_tp.py); 9 query heads do not split over 2."""
    cmd = [sys.executable, "-m", "pdserve.cli", "decode", "--model", model_path(), "--node-id", "d0",
           "--port", "1", "-tp", "2"]  # fmt: skip
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": "t" * 16}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    lines = [line for line in done.stderr.splitlines() if line.startswith("pdserve: error:")]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "tensor_parallel_size=2 does not divide the model's 9 query heads" in lines[0], lines[0]


def test_devices_name_one_gpu_per_rank_and_async_scheduling_is_on_on_gpus_at_any_size() -> None:
    from pdserve.shared.engine.config import EngineConfig

    def ranks(device: str, size: int) -> list[str]:
        cfg = EngineConfig(model="dummy:x", device=device, tensor_parallel_size=size)
        assert cfg.overlap == (device != "cpu")  # auto: the workers get the sampled tokens on the device
        return [str(cfg.rank_device(r)) for r in range(size)]

    assert ranks("cpu", 3) == ["cpu"] * 3
    assert ranks("cuda", 2) == ["cuda:0", "cuda:1"]  # the first N visible
    assert ranks("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert ranks("cuda:0,1", 2) == ["cuda:0", "cuda:1"]
    assert ranks("cuda:3,1", 2) == ["cuda:3", "cuda:1"]
    assert EngineConfig(model="dummy:x", device="cuda").overlap
    with pytest.raises(ValueError, match="names 2 GPUs for tensor_parallel_size=3"):
        EngineConfig(model="dummy:x", device="cuda:0,1", tensor_parallel_size=3)


def test_the_host_tier_of_a_tp_engine_holds_whole_blocks_within_its_bytes() -> None:
    """A host-tier slot holds every KV head of a block (a rank's pool holds a third of them at TP=3), so the
    slots are counted in whole-block bytes: before the fix the tier took 3x --host-kv-cache-gib."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import LLMEngine

    budget = 8 << 20
    cfg = EngineConfig(model=model_path(), tensor_parallel_size=3, kv_cache_bytes=4 << 20,
                       host_kv_cache_bytes=budget)  # fmt: skip
    engine = LLMEngine(cfg)
    try:
        assert engine.tier is not None
        host = engine.tier.host  # [slots, L, 2, B, H, D] with all 3 KV heads
        assert host.shape[-2] == 3
        assert budget // 2 < host.numel() * host.element_size() <= budget
    finally:
        engine.close()
