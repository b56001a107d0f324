"""`pdserve plan`'s refusals: one line on stderr naming the bad setting, and a non-zero exit, before anything
is read (the live behaviour is tests/test_plan_shifting.py's)."""

from __future__ import annotations

import pytest
from pdserve.cli.main import main


def test_a_metrics_port_without_watch_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "a-cluster-token-of-some-length")
    assert main(["plan", "--metrics-port", "9400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdserve: error: --metrics-port needs --watch SECONDS (a single decision serves nothing)"]


def test_a_missing_credential_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN_FILE", raising=False)
    assert main(["plan"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "PDSERVE_AUTH_TOKEN" in line and line.startswith("pdserve: error:")


def test_an_unreachable_index_ends_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "a-cluster-token-of-some-length")
    assert main(["plan", "--redis", "redis://127.0.0.1:1", "--window", "0.1"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("pdserve plan: error:") and "127.0.0.1" in line
