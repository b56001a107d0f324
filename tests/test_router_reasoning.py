"""router/reasoning.py: the qwen3 parser on whole outputs, the same output cut into every pair of deltas
(streamed text must add up to the whole output's split), and the chat chunk rewrite the router streams."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.router.reasoning import ChunkSplitter, split, split_message, splitter

CASES = [
    ("<think>\nplan it</think>\n\nThe answer is 4.", "\nplan it", "The answer is 4."),
    ("  <think>a < b</think>ok", "a < b", "ok"),
    ("<think></think>\n\nhi", "", "hi"),
    ("no thought here </think> at all", None, "no thought here </think> at all"),
    ("The <think> tag mid-text is content", None, "The <think> tag mid-text is content"),
    ("<think>cut off before the end </thi", "cut off before the end </thi", ""),
    ("<thi", None, "<thi"),
    ("", None, ""),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_qwen3_splits_whole_outputs(text: str, reasoning: str | None, content: str) -> None:
    assert split("qwen3", text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_any_cut_into_deltas_adds_up_to_the_whole_split(
    text: str, reasoning: str | None, content: str
) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            s = splitter("qwen3")
            parts = [s.feed(d) for d in (text[:i], text[i:j], text[j:])] + [s.finish()]
            assert "".join(r for r, _ in parts) == (reasoning or "")
            assert "".join(c for _, c in parts) == content


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n"]), max_size=10),
    st.lists(st.integers(0, 60), max_size=5),
)
def test_random_outputs_split_the_same_in_any_cut(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    reasoning, content = split("qwen3", text)
    s, parts, last = splitter("qwen3"), [], 0
    for cut in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        parts.append(s.feed(text[last:cut]))
        last = cut
    parts.append(s.finish())
    assert "".join(r for r, _ in parts) == (reasoning or "") and "".join(c for _, c in parts) == content


def test_held_tail_is_not_released_early() -> None:
    s = splitter("qwen3")
    assert s.feed("<think>why</") == ("why", "")
    assert s.feed("think>\n\nbecause") == ("", "because")


def test_unknown_parser_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"'deepseek' is not one of \['qwen3'\]"):
        splitter("deepseek")


def _chunk(index: int, content: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


def test_chunks_of_two_choices_split_into_reasoning_and_content_deltas() -> None:
    """The router's streaming path with a fake token stream: choice 0 thinks, choice 1 does not."""
    rewrite = ChunkSplitter("qwen3")
    stream = [
        _chunk(0, None, role=True),
        _chunk(1, None, role=True),
        _chunk(0, "<th"),
        _chunk(1, "Hello"),
        _chunk(0, "ink>two plus"),
        _chunk(0, " two</think>\n"),
        _chunk(1, " there", "stop"),
        _chunk(0, "\nFour", "stop"),
    ]
    out = [rewrite.chunk(c)["choices"][0] for c in stream]
    assert out[0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["delta"] for o in out[2:]] == [
        {},
        {"content": "Hello"},
        {"reasoning_content": "two plus"},
        {"reasoning_content": " two"},
        {"content": " there"},
        {"content": "Four"},
    ]


def test_non_streamed_message_gets_reasoning_content() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "<think>x</think>y"}}]}
    assert split_message("qwen3", body)["choices"][0]["message"] == {
        "role": "assistant",
        "reasoning_content": "x",
        "content": "y",
    }
