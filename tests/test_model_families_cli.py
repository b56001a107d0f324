"""Qwen3 and the mixture-of-experts families through the real `pdserve generate` (subprocesses): tiny seeded
HF checkpoints (tests/harness/tiny_models.py) give Hugging Face's greedy tokens; at TP=2 on gloo (each rank
holding its slice of every expert, the shared expert's too) they give TP=1's tokens; and a bad checkpoint
(unknown architecture, a MoE without its router weights, a missing tensor) ends in one error line and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.tests.harness.cluster_fixture import model_path
from pdserve.tests.harness.tiny_models import FAMILIES, hf_greedy, hf_tiny_model
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow
MAX_NEW = 12
PROMPT = "The three primary colors are"
PROGRESS = re.compile(r"^loading \S+: +\d+%\|")


def _generate(model: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--threads", "1", "--model", model,
           "--tokenizer", model_path(), "--kv-cache-gib", "0.01", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


def _run(model: str, *args: str) -> dict[str, list[int]]:
    proc = _generate(model, "--prompt", PROMPT, "--max-tokens", str(MAX_NEW), "--ignore-eos", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, list[int]] = json.loads(proc.stdout.splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    paths = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        hf_tiny_model(family).save_pretrained(path)
        paths[family] = str(path)
    return paths


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_gives_hf_greedy_tokens(family: str, checkpoints: dict[str, str]) -> None:
    out = _run(checkpoints[family])
    expected = hf_greedy(hf_tiny_model(family), list(out["prompt_token_ids"]), MAX_NEW)
    assert list(out["token_ids"]) == expected


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_tp2_gives_tp1_greedy_tokens(family: str, checkpoints: dict[str, str]) -> None:
    tp1 = _run(checkpoints[family])
    tp2 = _run(checkpoints[family], "--tensor-parallel-size", "2")
    assert len(tp1["token_ids"]) == MAX_NEW
    assert tp2["token_ids"] == tp1["token_ids"]


def _drop_tensors(src: str, dst: Path, pattern: str) -> None:
    """A copy of checkpoint `src` in `dst` without the tensors whose names match `pattern`."""
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors = {
                k: v for k, v in load_file(os.path.join(src, name)).items() if not re.search(pattern, k)
            }
            save_file(tensors, dst / name, metadata={"format": "pt"})
        else:
            (dst / name).write_bytes(Path(src, name).read_bytes())


@pytest.mark.parametrize(
    ("family", "change", "expected"),
    [
        ("qwen3", "arch", "model_type='deepseek_v3'; accepted: ("),
        ("qwen3_moe", r"layers\.0\.mlp\.gate\.weight", "weight 'model.layers.0.mlp.gate.weight' is missing"),
        ("mixtral", r"layers\.1\.block_sparse_moe\.experts\.3\.w2", "experts.3.w2.weight' is missing"),
        (
            "qwen3",
            r"layers\.1\.self_attn\.k_norm",
            "weight 'model.layers.1.self_attn.k_norm.weight' is missing",
        ),
    ],
    ids=["unknown-architecture", "moe-without-router", "missing-expert", "missing-qk-norm"],
)
def test_bad_checkpoint_is_one_line(
    family: str, change: str, expected: str, checkpoints: dict[str, str], tmp_path: Path
) -> None:
    if change == "arch":
        _drop_tensors(checkpoints[family], tmp_path, "^$")
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "deepseek_v3"}))
    else:
        _drop_tensors(checkpoints[family], tmp_path, change)
    proc = _generate(str(tmp_path), "--prompt", "hi", "--max-tokens", "2")
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pdserve: error: ") and expected in lines[0], lines[0]
