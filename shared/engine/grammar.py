"""Structured output's grammar engine (xgrammar) behind a small interface: `check` a constraint without a
tokenizer (the router's 400), `Grammars.compile` it for this tokenizer (cached by constraint), one `Matcher`
per request, `fill_masks` for a batch in one call, and `apply_masks` on the logits where they are.

Invariants: a Matcher has accepted exactly the first `consumed` output tokens of its request (`advance_to`
brings it to a request's output, rolling back when the output is shorter, so a token applied late or dropped
never leaves it ahead); it holds no other resource than its memory, so a request frees it by dropping it. A
bitmask row allows exactly the tokens that keep the output a prefix of the language, and only end tokens once
the output is complete. `fill_masks` writes into one of `_MASK_RING` host buffers allocated once (pinned for
a GPU engine) and reused in turn: the engine fills one mask per step and a step's mask is on the device
before the step after next is filled (its sampling, which follows the copy on the stream, was waited for),
so a buffer is never rewritten while its copy may be in flight. Why xgrammar, against llguidance:
docs/architecture.md (benchmarks/grammar_engines.py measures both).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from pdserve.shared.engine.sampling_params import Constraint
from pdserve.shared.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

_CACHE_LIMIT = 256
"""Compiled grammars kept per node (each a few hundred KiB to a few MiB for a 49k vocabulary)."""
_MASK_RING = 3
"""Host bitmask buffers used in turn (two would do: a third is margin)."""
_JSON_OBJECT = '{"type": "object"}'
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: .*? is false: )?")


@functools.cache
def _xgr() -> ModuleType:
    """xgrammar, imported on first use: it imports transformers (about a second and a half of CPU), which a
    process that never sees a constraint should not pay at start (the router warms it: `preload`)."""
    return importlib.import_module("xgrammar")


def preload() -> None:
    """Imports the grammar engine now (the router does before it serves, so no request's check imports it)."""
    _xgr()


class GrammarError(ValueError):
    """A constraint the engine cannot compile; the text names the problem."""


def _grammar(constraint: Constraint) -> xgr.Grammar:
    """The constraint as a tokenizer-free grammar: GrammarError naming the problem if it is not valid."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema" or kind == "json_object":
            schema = _JSON_OBJECT if kind == "json_object" else spec
            return _xgr().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return _xgr().Grammar.from_regex(spec)
        if kind == "choice":
            return _xgr().Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        return _xgr().Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"the {kind} constraint does not compile: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    """xgrammar's message without its native source location, first line, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return _NATIVE_PREFIX.sub("", lines[0])[:300] if lines else type(exc).__name__


def choice_ebnf(choices: object) -> str:
    """EBNF accepting exactly one of `choices` (a non-empty list of strings)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(constraint: Constraint) -> None:
    """GrammarError unless the constraint compiles (no tokenizer needed: milliseconds for a schema)."""
    _grammar(constraint)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar reads it; vocab_size is the logits' width (may exceed the tokenizer's)."""
    stop = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
    rust = tokenizer.rust_tokenizer
    if rust is not None:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=rust)
        return _xgr().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    # A byte-level tokenizer (dummy models): id i is byte i % 256; special ids decode to nothing here, which
    # xgrammar treats as special (never inside a sentence).
    special = tokenizer.special_token_ids
    vocab = [b"" if i in special else bytes([i % 256]) for i in range(vocab_size)]
    return _xgr().TokenizerInfo(vocab, _xgr().VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


class Matcher:
    """One request's grammar state."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = _xgr().GrammarMatcher(compiled)
        self.consumed = 0
        self.failed = False
        """A token the grammar refused was forced on it (it cannot happen under the mask): only an end
        token is allowed from then on."""

    def advance_to(self, output_token_ids: Sequence[int]) -> None:
        """Accepts the output tokens not accepted yet; rolls back any accepted beyond `output_token_ids`."""
        if self.consumed > len(output_token_ids):
            self._m.rollback(self.consumed - len(output_token_ids))
            self.consumed = len(output_token_ids)
        for token in output_token_ids[self.consumed :]:
            if self.failed or self._m.is_terminated():
                break
            if not self._m.accept_token(token):
                self.failed = True
            self.consumed += 1
        self.consumed = len(output_token_ids)

    @property
    def ended(self) -> bool:
        """The grammar accepted its end token, or refused one: it has no next-token mask of its own."""
        return self.failed or self._m.is_terminated()


class Grammars:
    """The compiled grammars of one engine's tokenizer, cached by constraint (thread-safe: the node's request
    handlers compile, the engine thread makes matchers)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, pinned: bool = False) -> None:
        """`pinned`: the masks go to a GPU, so their host buffers are page-locked (the copy does not wait)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pinned = pinned
        self._masks: list[torch.Tensor] = []  # [rows, ceil(V / 32)] int32 each, grown on demand
        self._next_mask = 0
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: dict[Constraint, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()
        self._batcher: xgr.BatchGrammarMatcher | None = None  # made at the first mask
        self.stop_ids = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar (cached; the first call builds the vocabulary's tables, about a second for
        49k tokens). GrammarError naming the problem."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                return hit
            if self._compiler is None:
                self._info = tokenizer_info(self._tokenizer, self.vocab_size)
                self._compiler = _xgr().GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        grammar = _grammar(constraint)
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise GrammarError(f"the {constraint.kind} constraint does not compile: {_reason(exc)}") from exc
        with self._lock:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[constraint] = compiled
        return compiled

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self.compile(constraint))

    def fill_masks(self, matchers: Sequence[Matcher | None]) -> torch.Tensor:
        """Bitmask [S, ceil(V / 32)] int32 on the host, row i for matchers[i]; a None row allows everything.
        One call fills every constrained row."""
        mask = self._mask_buffer(len(matchers))
        mask.fill_(-1)  # all bits set: allow all
        live = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.ended]
        if live:
            if self._batcher is None:
                # one thread: on a 16-core GPU host xgrammar's default (half the cores) made batch-64 decode
                # with a JSON schema 30 % slower than without, one thread 2 % (docs/benchmarks.md)
                self._batcher = _xgr().BatchGrammarMatcher(max_threads=1)
            self._batcher.batch_fill_next_token_bitmask(
                [m._m for _, m in live], mask, indices=[i for i, _ in live]
            )
        # Ended: a speculative step (async scheduling) after the end token, whose token is dropped, or a
        # refused token: only an end token may follow.
        ended = [i for i, m in enumerate(matchers) if m is not None and m.ended]
        if ended:
            mask[ended] = 0
            for t in self.stop_ids:
                mask[ended, t // 32] |= 1 << (t % 32)
        return mask

    def _mask_buffer(self, rows: int) -> torch.Tensor:
        """The next host buffer of the ring, its first `rows` rows ([rows, ceil(V / 32)] int32)."""
        words = (self.vocab_size + 31) // 32
        if not self._masks or self._masks[0].shape[0] < rows:
            capacity = max(rows, 2 * self._masks[0].shape[0] if self._masks else 0)
            self._masks = [
                torch.empty((capacity, words), dtype=torch.int32, pin_memory=self._pinned)
                for _ in range(_MASK_RING)
            ]
        buf = self._masks[self._next_mask]
        self._next_mask = (self._next_mask + 1) % _MASK_RING
        return buf[:rows]


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float32 with every token a bitmask [S, ceil(V / 32)] (host) forbids at -inf, in place,
    on the logits' device (the mask goes there without waiting: pinned memory on a GPU)."""
    if logits.is_cuda:
        host = bitmask if bitmask.is_pinned() else bitmask.pin_memory()
        bitmask = host.to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=min(logits.shape[1], bitmask.shape[1] * 32)
    )
    return logits
