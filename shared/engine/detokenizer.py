"""Incremental detokenization of one request's output, with stop strings and stop tokens.

Invariants:
- The deltas returned by add() and flush(), joined, equal `text` exactly, and `text` only grows.
- Text is released only when stable: a decode window ending in U+FFFD (an incomplete UTF-8 sequence split
  across tokens) is held until a later token completes it, flush(), or MAX_HELD_TOKENS tokens have piled up
  (no UTF-8 character spans more than 4 bytes, so such a run is invalid for good and is released as U+FFFD;
  without the bound a run of invalid bytes would grow the window, and each decode, without limit); a suffix
  that is a proper prefix of a stop string is held until it is ruled out (not needed when
  include_stop_str_in_output).
- A stop string ends the request at its first occurrence that ends after the first params.min_tokens output
  tokens (vLLM's rule: text within them is not searched); the text ends before it (or after it with
  include_stop_str_in_output) and later tokens add nothing. A stop token (params.stop_token_ids, or an EOS
  id unless ignore_eos) ends it too; its own text is dropped unless include_stop_str_in_output.
Decoding uses only `tokenizer.decode(ids, skip_special_tokens=...)`, over a window that starts with the
last prompt tokens, so a first output token decodes as it would after the prompt.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from pdserve.shared.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 6
MAX_HELD_TOKENS = 8
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._ids = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        self._prefix_offset = 0  # window start: context for the undecoded tokens
        self._read_offset = len(self._ids)  # tokens before this are in _decoded
        self._decoded = ""  # stable text of the output tokens read so far
        self._searched = 0  # chars of _decoded already searched for stop strings
        self._end: int | None = None  # length of the final text once a stop string was found
        self._emitted = 0
        self._read_tokens = 0  # output tokens read; stop strings count once it passes params.min_tokens
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.stop_reason: int | str | None = None
        """The stop string or stop token id that ended the output (None for EOS or no stop)."""
        self.finished = False
        """True once a stop string or stop token ended the output."""

    @property
    def text(self) -> str:
        """The output text released so far."""
        return self._decoded[: self._emitted]

    def add(self, token_ids: Sequence[int]) -> str:
        """Reads newly sampled tokens; returns the text delta they release ("" once finished)."""
        for token in token_ids:
            if self.finished:
                break
            self._read_tokens += 1
            if token in self._stop_ids:
                self.finished = True
                self.stop_reason = token if token in self._params.stop_token_ids else None
                if self._params.include_stop_str_in_output:
                    self._read(token)
                self._read_pending()
                self._search_stop()
            else:
                self._read(token)
                self._search_stop()
        return self._release()

    def flush(self) -> str:
        """Releases all held text (an incomplete UTF-8 tail decodes as U+FFFD); call when the request ends."""
        if not self.finished:
            self._read_pending()
            self._search_stop()
        end = len(self._decoded) if self._end is None else self._end
        return self._take(end)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._params.skip_special_tokens)

    def _read(self, token: int) -> None:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        held = len(self._ids) - self._read_offset
        if len(new_text) > len(prefix_text) and (
            not new_text.endswith(_REPLACEMENT) or held >= MAX_HELD_TOKENS
        ):
            self._decoded += new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _read_pending(self) -> None:
        """Takes the held window as it decodes now, U+FFFD included."""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            self._decoded += new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _search_stop(self) -> None:
        if self._end is not None or not self._max_stop:
            return
        if self._read_tokens <= self._params.min_tokens:
            self._searched = len(self._decoded)
            return
        start = max(0, self._searched - self._max_stop + 1)
        self._searched = len(self._decoded)
        found = [(i, s) for s in self._params.stop if (i := self._decoded.find(s, start)) >= 0]
        if found:
            index, stop = min(found)
            self._end = index + len(stop) if self._params.include_stop_str_in_output else index
            self.finished = True
            self.stop_reason = stop

    def _release(self) -> str:
        if self._end is not None:
            return self._take(self._end)
        end = len(self._decoded)
        if not self.finished and not self._params.include_stop_str_in_output:
            end -= self._stop_prefix_len()
        return self._take(end)

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of _decoded that is a proper prefix of some stop string."""
        text, best = self._decoded, 0
        for stop in self._params.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta
