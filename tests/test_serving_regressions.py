"""Regression tests of issue 17 ("Ordinary traffic must not fail"), one per defect, each through real
processes: a real redis-server, real nodes and router started as `pdserve up` starts them
(tests/cluster_fixture.py), the real command-line tools. Each failing scenario ends with the audits of every
node clean (in_use = reserved = 0 with no live request).

Functions are named after the defect they pin: test_defect3_* (Redis restarted empty), test_defect4_* (a node
with another credential), test_defect5_* (/health), test_defect6_* (what the operator sees), test_defect7_*
(a plain clone tests itself).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_defect7_a_plain_clone_tests_itself(tmp_path: Path) -> None:
    """The repository's own files, copied where nothing lies beside them (no ../shared), run the tests that
    validate bodies against OpenAI's schemas."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    clone = tmp_path / "clone" / "pdserve"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    (clone / ".build").mkdir()
    (clone / ".build" / "pdserve").symlink_to("..")
    assert not (clone.parent / "shared").exists()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_router_openai.py"],
        cwd=clone, env=os.environ | {"PYTHONPATH": str(clone / ".build")}, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
