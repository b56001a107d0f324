"""One output type from the engine to the router: the engine's `StepOutput` is the node protocol's NDJSON
line; the node's own clock readings stay on the node, and every error output is built one way."""

from __future__ import annotations

import json

import pytest
from pdserve.shared.node.node_protocol import ENGINE_FAILURE, StepOutput, TokenLogprob, TopLogprob
from pdserve.shared.types import RequestId
from pdserve.shared.wire import WireError


def test_a_step_output_travels_without_the_nodes_clock_readings() -> None:
    lp = TokenLogprob(7, "a", -0.5, (97,), (TopLogprob("a", 7, -0.5, (97,)), TopLogprob("b", 8, -1.5, (98,))))
    out = StepOutput(RequestId("r"), (7,), "a", (lp,), None, 3, 1, 0, arrival_time=12.5, scheduled_time=13.0)
    line = out.to_line()
    assert "arrival_time" not in json.loads(line) and "scheduled_time" not in json.loads(line)
    back = StepOutput.from_line(line)
    assert back == out and (back.arrival_time, back.scheduled_time) == (0.0, None)
    with pytest.raises(WireError, match="unknown field"):
        StepOutput.from_line(line.replace(b'"error"', b'"arrival_time":1.0,"error"'))


def test_an_error_output_says_why_and_counts_the_prompt() -> None:
    out = StepOutput.failed(RequestId("r"), 5)
    assert (out.finish_reason, out.error, out.prompt_tokens, out.completion_tokens, out.finished) == (
        "error",
        ENGINE_FAILURE,
        5,
        0,
        True,
    )
    assert StepOutput.failed(RequestId("r"), 5, "deadline exceeded").error == "deadline exceeded"


def test_a_moved_requests_last_line_carries_the_migration_signal() -> None:
    """A drain with --migrate ends a request with an abort line marked `migrate` (the router continues it
    elsewhere); the mark means nothing on another finish, so it is refused there."""
    moved = StepOutput(RequestId("r"), (), "", None, "abort", 5, 9, 0, migrate=True)
    assert StepOutput.from_line(moved.to_line()) == moved and StepOutput.from_line(moved.to_line()).migrate
    with pytest.raises(ValueError, match="migrate set but finish_reason is 'stop'"):
        StepOutput(RequestId("r"), (), "", None, "stop", 5, 9, 0, migrate=True)
