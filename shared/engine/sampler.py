"""Turns a step's logits into tokens and logprobs, one row per sequence that samples.

Invariants:
- Randomness is a pure function of (seed, position): each row draws by inverse CDF with one uniform
  number derived (exactly, in Python integers) from a 64-bit mix of the seed and the position, so the
  token drawn for a row does not depend on the other rows of the batch, on the step, or on the node (a
  request prefilled on P and continued on D gives the text a single node gives, up to float rounding
  differences between device kinds). A request without a seed gets a key drawn from
  the sampler's own RNG, so only seeded requests are reproducible.
- Processing order: penalties (repetition over prompt + output, frequency/presence over output) ->
  logit_bias -> the grammar mask of constrained rows (tokens it forbids at -inf) -> min_tokens (EOS and stop
  token ids at -inf while fewer than min_tokens output tokens exist, unless the grammar allows nothing
  else) -> temperature -> top-k -> top-p -> min-p -> draw. Temperature below 1e-5 is greedy: argmax after
  min_tokens.
- Logprobs (OpenAI-like): log-softmax of the logits after penalties, logit_bias and the grammar mask (a
  forbidden token's logprob is -inf, clamped on the wire) and before min_tokens, temperature and
  truncation, so they describe the model's (biased) distribution for the context, are finite for every
  token, and do not change with min_tokens/temperature/top-k/top-p; the sampled token's logprob comes from
  the same distribution.
- `argmax_suffices` says when a step's tokens are just its logits' argmax (every row greedy, with nothing
  above that changes or reads the logits): a tensor-parallel engine then reduces the argmax across ranks
  instead of gathering the logits (`ModelRunner.execute(argmax=True)`), and `chosen` wraps its tokens.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pdserve.shared.engine.grammar import apply_masks
from pdserve.shared.engine.sampling_params import SamplingParams

GREEDY_EPS = 1e-5
_M64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class SamplingState:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    position: int
    """Index in prompt + output of the token being sampled: len(prompt) + len(output) so far."""


@dataclass(frozen=True)
class SampleOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    """The sampled token's logprob; None where params.logprobs is None."""
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...]
    """(token id, logprob) of the params.logprobs most likely tokens, most likely first; None if not asked."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """64-bit key of one draw: a mix of the request's seed and the sampled token's position."""
    return _splitmix64((seed & _M64) ^ _splitmix64(position))


def row_uniform(key: int) -> float:
    """u in (0, 1) from a 64-bit key, exact in float64 (53 bits)."""
    return ((key >> 11) + 0.5) / (1 << 53)


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids: frozenset[int] = frozenset()) -> None:
        """seed: of the RNG that gives unseeded requests their keys (None: from the OS). eos_token_ids: the
        model's end tokens, held back (with each request's stop_token_ids) until its min_tokens."""
        self._rng = random.Random(seed)
        self._eos = eos_token_ids

    @staticmethod
    def argmax_suffices(states: Sequence[SamplingState]) -> bool:
        """Whether every row's token is the argmax of its raw logits: greedy (temperature < GREEDY_EPS, so
        top-k/top-p/min-p do not apply), no logprobs, no penalties, no logit_bias, no grammar mask, and
        min_tokens met (no stop token held back)."""
        return all(
            s.params.temperature < GREEDY_EPS
            and s.params.logprobs is None
            and not s.params.penalized
            and not s.params.logit_bias
            and s.params.constraint is None
            and s.position - len(s.prompt_token_ids) >= s.params.min_tokens
            for s in states
        )

    @staticmethod
    def chosen(tokens: torch.Tensor) -> PendingSample:
        """A step's greedy tokens [S] int64 (on the device), when `argmax_suffices` held for its rows."""
        return PendingSample(tokens, [], [], None)

    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """logits: [S, V] float32, one row per state, in the order of states."""
        return self.launch(logits, states, bitmask).result()

    @torch.inference_mode()
    def launch(
        self, logits: torch.Tensor, states: Sequence[SamplingState], bitmask: torch.Tensor | None = None
    ) -> PendingSample:
        """Queues the sampling of `logits` [S, V] float32 on their device and returns at once (unless a
        top-p row needs a wider candidate list); the tokens stay on the device for the next step's input
        and reach the host through `PendingSample.result()`. bitmask: [S, ceil(V / 32)] int32 on the host,
        the grammar's allowed tokens per row (shared/engine/grammar.py), or None."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be float32 [{len(states)}, V]; got {logits.dtype} {list(logits.shape)}"
            )
        num = logits.shape[0]
        dev = logits.device
        if num == 0:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=dev), [], [], None)
        logits = _apply_bias(self._apply_penalties(logits, states), states)  # [S, V]
        if bitmask is not None:
            logits = apply_masks(logits.clone(), bitmask)  # [S, V]; the runner's buffer stays as it was
        scores = self._hold_stops(logits, states)  # [S, V]: what is drawn from; logprobs read `logits`
        if bitmask is not None and scores is not logits:
            # a complete grammar allows only the end tokens min_tokens holds back: the grammar wins
            nothing = (scores == float("-inf")).all(dim=-1, keepdim=True)  # [S, 1]
            scores = torch.where(nothing, logits, scores)
        greedy = [i for i, s in enumerate(states) if s.params.temperature < GREEDY_EPS]
        rand = [i for i, s in enumerate(states) if s.params.temperature >= GREEDY_EPS]
        if not rand:
            tokens = scores.argmax(dim=-1)  # [S]
        elif not greedy:
            tokens = self._draw(scores, states)
        else:
            tokens = torch.empty(num, dtype=torch.int64, device=dev)
            idx = torch.tensor(greedy, device=dev)
            tokens[idx] = scores[idx].argmax(dim=-1)
            idx = torch.tensor(rand, device=dev)
            tokens[idx] = self._draw(scores[idx], [states[i] for i in rand])
        want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        counts = [states[i].params.logprobs or 0 for i in want]
        lps = None
        if want:
            idx = torch.tensor(want, device=dev)
            lp = torch.log_softmax(logits[idx], dim=-1)  # [W, V]
            chosen = lp.gather(1, tokens[idx, None])[:, 0]
            n_max = max(counts)
            top_v, top_i = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
            lps = (chosen, top_v, top_i)
        return PendingSample(tokens, want, counts, lps)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        rows = [i for i, s in enumerate(states) if s.params.penalized]
        if not rows:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        logits = logits.clone()
        sub = logits[rows]  # [P, V]
        counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=dev)
        seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
        out_flat = _flat_index([states[i].output_token_ids for i in rows], vocab, dev)
        counts.view(-1).index_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.float32))
        seen.view(-1)[out_flat] = True
        seen.view(-1)[_flat_index([states[i].prompt_token_ids for i in rows], vocab, dev)] = True

        def col(name: str) -> torch.Tensor:
            vals = [float(getattr(states[i].params, name)) for i in rows]
            return torch.tensor(vals, dtype=torch.float32, device=dev)[:, None]  # [P, 1]

        rep = col("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0).float()
        logits[rows] = sub
        return logits

    def _hold_stops(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """logits [S, V] with the stop tokens (EOS and stop_token_ids) of each row still short of its
        min_tokens at -inf; the same tensor when no row is."""
        vocab = logits.shape[1]
        rows, held = [], []
        for i, s in enumerate(states):
            if s.position - len(s.prompt_token_ids) < s.params.min_tokens:
                rows.append(i)
                held.append([t for t in self._eos.union(s.params.stop_token_ids) if t < vocab])
        if not rows:
            return logits
        logits = logits.clone()
        sub = logits[rows]  # [H, V]
        sub.view(-1)[_flat_index(held, vocab, logits.device)] = float("-inf")
        logits[rows] = sub
        return logits

    def _draw(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """logits: [R, V] after penalties, all rows with temperature >= GREEDY_EPS; returns tokens [R]."""
        dev = logits.device
        temp = torch.tensor([s.params.temperature for s in states], dtype=torch.float32, device=dev)
        x = _truncate(logits / temp[:, None], states)  # [R, V], dropped tokens at -inf
        if any(s.params.min_p > 0.0 for s in states):
            min_p = torch.tensor([s.params.min_p for s in states], dtype=torch.float32, device=dev)[:, None]
            probs = x.softmax(dim=-1)
            x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        keys = [
            noise_key(s.params.seed if s.params.seed is not None else self._rng.getrandbits(64), s.position)
            for s in states
        ]
        # Inverse CDF with one uniform per row: the row's token depends only on its logits and its key.
        # searchsorted(right) returns the first index whose cdf exceeds the target, never a zero-prob token.
        cdf = x.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
        u = torch.tensor([row_uniform(k) for k in keys], dtype=torch.float64, device=dev)
        target = (u * cdf[:, -1].double()).float()[:, None]  # [R, 1]
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


class PendingSample:
    """One step's sampled tokens (and logprobs), queued on the logits' device. `tokens` stays there (the
    next step may read it as input); `result()` waits for the copies to the host with the GIL released."""

    def __init__(
        self,
        tokens: torch.Tensor,
        want: list[int],
        counts: list[int],
        lps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.tokens = tokens  # [S] int64
        self._want, self._counts = want, counts
        parts = [tokens, *(lps or ())]
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for h, t in zip(host, parts, strict=True):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))
            parts = host
        self._host = parts

    def wait(self) -> None:
        """Returns once the step that produced these tokens has finished on its device."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> SampleOutput:
        self.wait()
        token_list: list[int] = self._host[0].tolist()
        num = len(token_list)
        logprobs: list[float | None] = [None] * num
        tops: list[tuple[tuple[int, float], ...] | None] = [None] * num
        if self._want:
            chosen, top_vs, top_is = (t.tolist() for t in self._host[1:])
            for j, (i, n) in enumerate(zip(self._want, self._counts, strict=True)):
                logprobs[i] = chosen[j]
                tops[i] = tuple(zip(top_is[j][:n], top_vs[j][:n], strict=True))
        return SampleOutput(tuple(token_list), tuple(logprobs), tuple(tops))


def _truncate(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Top-k then top-p (over the top-k renormalized) on temperature-scaled logits x [R, V]. The nucleus is
    found in a top-K candidate list, K growing 8x until it holds every row's nucleus (no full-vocab sort
    in the common case: a full sort costs tens of times a top-256 on a CPU)."""
    dev, vocab = x.device, x.shape[1]
    k_row = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in states]
    p_row = [s.params.top_p for s in states]
    limited = [k < vocab or p < 1.0 for k, p in zip(k_row, p_row, strict=True)]
    if not any(limited):
        return x
    k_lim = torch.tensor(k_row, device=dev)[:, None]  # [R, 1]
    top_p = torch.tensor(p_row, dtype=torch.float32, device=dev)[:, None]  # [R, 1]
    by_k = torch.tensor([k < vocab for k in k_row], device=dev)[:, None]  # [R, 1]
    lse_full = x.logsumexp(dim=-1, keepdim=True)  # [R, 1]
    cand = min(vocab, max([k for k in k_row if k < vocab] + [256]))
    while True:
        vals, idx = x.topk(cand, dim=-1)  # [R, K] descending
        in_k = torch.arange(cand, device=dev)[None, :] < k_lim  # [R, K]
        vals = torch.where(in_k, vals, float("-inf"))
        lse = torch.where(by_k, vals.logsumexp(dim=-1, keepdim=True), lse_full)
        probs = (vals - lse).exp()  # [R, K]
        mass = probs.cumsum(dim=-1)
        covered = by_k | (top_p >= 1.0) | (mass[:, -1:] >= top_p)
        if cand == vocab or bool(covered.all()):
            break
        cand = min(vocab, cand * 8)
    keep = in_k & (((mass - probs) < top_p) | (top_p >= 1.0))  # the top token has 0 mass before it
    out = torch.full_like(x, float("-inf")).scatter_(1, idx, torch.where(keep, vals, float("-inf")))
    return torch.where(torch.tensor(limited, device=dev)[:, None], out, x)


def _apply_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """logits [S, V] plus each row's logit_bias (ids past the logits' width are the router's to refuse and
    are skipped here); the same tensor when no row has a bias."""
    vocab = logits.shape[1]
    rows = [[(t, b) for t, b in s.params.logit_bias if t < vocab] for s in states]
    if not any(rows):
        return logits
    flat = _flat_index([[t for t, _ in r] for r in rows], vocab, logits.device)  # [B]
    bias = torch.tensor([b for r in rows for _, b in r], dtype=torch.float32, device=logits.device)  # [B]
    logits = logits.clone()
    logits.view(-1).index_add_(0, flat, bias)
    return logits


def _flat_index(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Indices into a row-major [len(rows), vocab] tensor of every (row, token) pair."""
    flat = array("q")
    for ids in rows:
        flat.extend(ids)
    if not flat:
        return torch.zeros(0, dtype=torch.int64, device=device)
    tokens = torch.frombuffer(flat, dtype=torch.int64).to(device)  # [N]
    lens = torch.tensor([len(ids) for ids in rows], device=device)
    return torch.repeat_interleave(torch.arange(len(rows), device=device) * vocab, lens) + tokens
