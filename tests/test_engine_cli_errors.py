"""Bad input to the real `pdserve generate` (a subprocess): each ends with a non-zero exit and exactly one
error line on stderr that names the bad value, and nothing on stdout.

The weight-loading progress bar (tqdm) also writes to stderr; its lines are set aside before counting, so
"one line" means one line besides the progress bar.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
PROGRESS = re.compile(r"^loading \S+: +\d+%\|")
LONG_PROMPT = "word " * 100  # 101 tokens, over a 64-token context


def _generate_fails(*args: str) -> str:
    """Runs the CLI, asserts a non-zero exit and one error line; returns that line."""
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--threads", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    assert proc.stdout == "", proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pdserve: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens=0"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0"),
        (["--prompt", "hi", "--top-p", "2"], "top_p=2.0"),
        (["--messages", "[]"], "--messages must be a non-empty JSON list"),
    ],
    ids=["empty-prompt", "max-tokens-0", "negative-temperature", "top-p-2", "no-messages"],
)
def test_bad_request_values_fail_before_loading(args: list[str], expected: str) -> None:
    assert expected in _generate_fails(*args)


def test_empty_prompt_in_prompts_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": ""}) + "\n", encoding="utf-8")
    assert "the prompt is empty" in _generate_fails("--prompts-file", str(path))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ({"prompt": "hi", "max_tokenz": 3}, "unknown sampling parameter(s) ['max_tokenz']"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens=0"),
        ({"prompt": "hi", "stop": "."}, "stop='.' is not accepted; stop must be a list"),
        ({"messages": [{"role": "user"}]}, "needs 'role' and 'content'"),
    ],
    ids=["unknown-field", "max-tokens-0", "stop-not-a-list", "message-without-content"],
)
def test_bad_line_in_prompts_file(tmp_path: Path, line: dict[str, object], expected: str) -> None:
    """A line's own sampling fields are checked like the command's: the error names the file and line."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps(line) + "\n", encoding="utf-8")
    error = _generate_fails("--prompts-file", str(path))
    assert f"{path}, line 3: " in error and expected in error


def test_prompt_over_context(tmp_path: Path) -> None:
    line = _generate_fails("--prompt", LONG_PROMPT, "--max-model-len", "64", "--max-tokens", "4")
    assert "exceeds the model's context of 64 tokens" in line and "prompt (101 tokens)" in line


def test_missing_model_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.gguf")
    line = _generate_fails("--prompt", "hi", "--model", missing)
    assert missing in line and "no such file" in line


def test_missing_model_dir(tmp_path: Path) -> None:
    line = _generate_fails("--prompt", "hi", "--model", str(tmp_path))
    assert str(tmp_path) in line and "config.json" in line


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 16, b"GGUF\x03\x00\x00\x00truncated header"],
    ids=["garbage-bytes", "truncated-header"],
)
def test_corrupt_gguf(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(content)
    line = _generate_fails("--prompt", "hi", "--model", str(bad))
    assert f"cannot load model from {bad}" in line


def test_fp8_weights_on_the_cpu() -> None:
    line = _generate_fails("--prompt", "hi", "--quantization", "fp8")
    assert "with --quantization fp8: FP8 weights need a GPU of compute capability 8.9 or newer" in line, line
