"""The README's `make up` (issue 31, point 8): it installs the runtime alone, into the project's own
virtualenv, and refuses a virtualenv whose `pdserve` is another checkout instead of running that checkout.
Both run make for real on copies of the Makefile; nothing is installed (the install stamp is held old)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _copy(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def test_make_up_installs_the_runtime_alone_into_dot_venv(tmp_path: Path) -> None:
    planned = subprocess.run(["make", "-n", "up"], cwd=_copy(tmp_path), capture_output=True, text=True,
                             timeout=60, check=True).stdout  # fmt: skip
    installs = [line for line in planned.splitlines() if " pip install " in line]
    assert any(line.rstrip().endswith("--python .venv/bin/python -e .") for line in installs), planned
    assert not any("[test" in line or "kubectl" in line or "mypy" in line for line in installs), installs
    # xgrammar's triton (0.6 GB, not the pinned version) stays out of the runtime: only [gpu] brings it
    assert all(
        "--override .venv/no-triton.txt" in line for line in installs if line.rstrip().endswith("-e .")
    ), installs
    assert 'triton ; sys_platform == "never"' in planned
    assert ".venv/bin/python -m pdserve.cli up" in planned


def test_make_refuses_a_venv_whose_pdserve_is_another_checkout(tmp_path: Path) -> None:
    """This test's own virtualenv resolves `pdserve` to this checkout, not to the copy: make must say so."""
    copy = _copy(tmp_path)
    (copy / ".venv").symlink_to(Path(sys.prefix))
    done = subprocess.run(["make", "-o", ".venv/.pdserve-runtime", "deps"], cwd=copy, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode != 0
    assert "does not resolve to this checkout" in done.stderr and "remove .venv" in done.stderr, done.stderr
