"""The one placement cost model: for one prompt and the nodes the policy picked, the estimated time to first
token of each way to prefill it, and the cheapest. Pure Python over plain data; no I/O.

Options (docs/architecture.md, "Design in brief"; three of them the first plan's, local_fetch added):
- `local`: the decode node prefills the tokens it does not hold itself (no transfer);
- `local_fetch`: the decode node first fetches the prefix blocks a holder has beyond its own, then computes
  the rest itself (one move of the prefix, straight to the node that needs it; docs/architecture.md);
- `pd`: the prefill node computes what it does not hold and streams the KV to D;
- `pd_fetch`: the prefill node first fetches the prefix blocks a holder has beyond its own, then computes
  the rest and streams to D.
(A prefix in a node's host tier counts as that node's own: the engine restores it before scheduling.)

Estimate = learned overhead of the option + queue + compute + moved blocks, where every rate is learned
online from what the router observes (EWMA, weight `alpha`; the first observation of a rate replaces its
prior, an overhead moves from its prior), and only until a first observation the prior of `Rates` stands
in:
- a prefill's seconds as a line in the tokens it computes (plus the tokens queued before it): a fixed
  cost per prefill (a step reads every weight; a request crosses processes) plus seconds per token, fitted
  per prompt-length bucket (powers of two: attention grows with the context) by exponentially weighted
  least squares over each prefill node's reported compute times and local prefills' times to first token;
  an unseen bucket takes the nearest seen one (a line through zero per token, before two different token
  counts were seen in a bucket, then the prior `prior_s_per_token`, stand in);
- fetch seconds per block, from the prefill node's report (a fetch runs before the compute, so all of it
  adds to the time to first token);
- transfer seconds per sent block (P -> D) of the transfer's tail: the part left after the compute, from
  the first token to D's acknowledgement (the rest streams under the compute and costs nothing);
- per option, the residual between the measured time to first token and the estimate's other terms
  (routing, HTTP, the OPEN round trip).
The cheapest estimate is chosen, except that each option is tried once while it is within a factor of the
cheapest (`choose`): what is never chosen is never learned.
Queue depths come from the nodes' heartbeats (tokens not computed yet). Units: seconds, tokens, blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pdserve.shared.wire import Codec, JsonMessage

CODEC = Codec("placement rates", 2)
Option = Literal["local", "local_fetch", "pd", "pd_fetch"]
OPTIONS: tuple[Option, ...] = ("local", "local_fetch", "pd", "pd_fetch")
EXPLORE_WITHIN = 2.0
"""An option not observed yet is tried once when its estimate is at most this many times the cheapest's."""


@dataclass
class Rates(JsonMessage):
    """What the model has learned (or, before any observation, its priors). Its JSON (the one codec's,
    versioned) is the record the router keeps in the index for `kvctl where`."""

    codec = CODEC

    prefill_fit: dict[int, tuple[float, float, float, float, float]] = field(default_factory=dict)
    """By prompt-length bucket (the bucket's upper bound, a power of two): the exponentially weighted sums
    (weight, x, y, x*x, x*y) of prefills' computed tokens x against their seconds y."""
    prior_s_per_token: float = 1e-3
    fetch_s_per_block: float | None = None
    """A fetch's time per block, from the prefill nodes' reports (None: none yet, `prior_s_per_block`)."""
    transfer_s_per_block: float | None = None
    """The time per sent block of the transfer to D left after the compute (its unoverlapped tail)."""
    prior_s_per_block: float = 1e-4
    overhead_s: dict[str, float] = field(default_factory=dict)
    """Per option, learned; an option not observed yet takes `prior_overhead_s`."""
    prior_overhead_s: float = 5e-3
    observations: int = 0


def bucket(tokens: int) -> int:
    """The power-of-two bucket (upper bound, at least 16) a prompt of `tokens` tokens falls in."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(1, tokens)))))


@dataclass(frozen=True)
class Inputs:
    """One prompt against the chosen pair: token counts and blocks in the units the estimate uses."""

    prompt_tokens: int
    block_size: int
    hits_prefill: int
    """Leading prompt blocks the prefill node holds (any tier)."""
    hits_decode: int
    hits_holder: int
    """Leading prompt blocks the best holder other than the prefill node has (0: none)."""
    queued_prefill: int
    """Tokens queued on the prefill node (heartbeat)."""
    queued_decode: int
    has_prefill_node: bool = True
    hits_holder_decode: int = 0
    """Leading prompt blocks the best holder other than the decode node has (0: none)."""


@dataclass(frozen=True)
class Estimate:
    option: Option
    ttft_s: float
    compute_tokens: int
    fetch_blocks: int = 0


class CostModel:
    def __init__(self, rates: Rates | None = None, alpha: float = 0.2, fit_alpha: float = 0.05) -> None:
        """alpha: the EWMA weight of a new observation of a rate or overhead; fit_alpha: the weight by which
        each new prefill discounts the older ones in its bucket's fit."""
        for name, value in (("alpha", alpha), ("fit_alpha", fit_alpha)):
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]")
        self.rates = rates or Rates()
        self.alpha = alpha
        self.fit_alpha = fit_alpha

    # ---- estimates --------------------------------------------------------------------------------------
    def prefill_line(self, prompt_tokens: int) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a prefill in the prompt's bucket (or the nearest fitted)."""
        fits = self.rates.prefill_fit
        if not fits:
            return 0.0, self.rates.prior_s_per_token
        b = bucket(prompt_tokens)
        w, sx, sy, sxx, sxy = (
            fits[b] if b in fits else fits[min(fits, key=lambda k: abs(k.bit_length() - b.bit_length()))]
        )
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > (0.1 * mx) ** 2:  # token counts differ enough to tell the fixed cost from the per-token one
            slope = (sxy / w - mx * my) / var
            fixed = my - slope * mx
            if slope >= 0 and fixed >= 0:
                return fixed, slope
            if slope < 0:
                return my, 0.0
        return 0.0, sxy / sxx

    def overhead(self, option: Option) -> float:
        """The option's learned overhead (the prior of a record written before the option existed)."""
        return self.rates.overhead_s.get(option, self.rates.prior_overhead_s)

    def fetch_s_per_block(self) -> float:
        r = self.rates
        return r.fetch_s_per_block if r.fetch_s_per_block is not None else r.prior_s_per_block

    def transfer_s_per_block(self) -> float:
        r = self.rates
        return r.transfer_s_per_block if r.transfer_s_per_block is not None else r.prior_s_per_block

    def _compute_s(self, queued: int, tokens: int, prompt_tokens: int) -> float:
        fixed, per_token = self.prefill_line(prompt_tokens)
        return fixed + (queued + tokens) * per_token

    def estimates(self, x: Inputs) -> list[Estimate]:
        """Every option open for the prompt, cheapest first."""
        bs, n = x.block_size, x.prompt_tokens
        blocks = -(-n // bs)
        usable = (n - 1) // bs  # the block holding the last token is always computed
        out = []
        c_local = n - min(x.hits_decode, usable) * bs
        out.append(
            Estimate("local", self.overhead("local") + self._compute_s(x.queued_decode, c_local, n), c_local)
        )
        fetch_d = min(x.hits_holder_decode, usable) - min(x.hits_decode, usable)
        if fetch_d > 0:
            c_lf = n - min(x.hits_holder_decode, usable) * bs
            t = self.overhead("local_fetch") + fetch_d * self.fetch_s_per_block()
            out.append(Estimate("local_fetch", t + self._compute_s(x.queued_decode, c_lf, n), c_lf, fetch_d))
        if x.has_prefill_node:
            send = (blocks - x.hits_decode) * self.transfer_s_per_block()
            c_pd = n - min(x.hits_prefill, usable) * bs
            pd = self.overhead("pd") + self._compute_s(x.queued_prefill, c_pd, n) + send
            out.append(Estimate("pd", pd, c_pd))
            fetch = min(x.hits_holder, usable) - min(x.hits_prefill, usable)
            if fetch > 0:
                c_f = n - min(x.hits_holder, usable) * bs
                t = self.overhead("pd_fetch") + fetch * self.fetch_s_per_block()
                t += self._compute_s(x.queued_prefill, c_f, n) + send
                out.append(Estimate("pd_fetch", t, c_f, fetch))
        return sorted(out, key=lambda e: e.ttft_s)

    def choose(self, x: Inputs) -> Estimate:
        """The cheapest option; but an open option whose time to first token was never observed (its
        overhead, and maybe its per-block rate, still priors) is tried once when its estimate is within
        `EXPLORE_WITHIN` of the cheapest. An option never chosen is never measured, so a prior too
        pessimistic for this cluster (a transfer's cost on a fast link) would otherwise stand for good."""
        est = self.estimates(x)
        limit = EXPLORE_WITHIN * est[0].ttft_s
        return next((e for e in est if e.option not in self.rates.overhead_s and e.ttft_s <= limit), est[0])

    # ---- learning -----------------------------------------------------------------------------------------
    def _ewma(self, old: float | None, new: float) -> float:
        """The first observation replaces the prior; later ones move the average by `alpha`."""
        return new if old is None else old + self.alpha * (new - old)

    def observe_prefill(self, prompt_tokens: int, computed_tokens: int, seconds: float) -> None:
        """A prefill node computed `computed_tokens` of a `prompt_tokens` prompt in `seconds`."""
        if computed_tokens <= 0 or seconds <= 0:
            return
        fits, b, x = self.rates.prefill_fit, bucket(prompt_tokens), float(computed_tokens)
        keep = 1.0 - self.fit_alpha
        w, sx, sy, sxx, sxy = (keep * v for v in fits.get(b, (0.0,) * 5))
        fits[b] = (w + 1.0, sx + x, sy + seconds, sxx + x * x, sxy + x * seconds)
        self.rates.observations += 1

    def observe_moves(self, fetched_blocks: int, fetch_s: float, sent_blocks: int, send_s: float) -> None:
        r = self.rates
        if fetched_blocks > 0 and fetch_s > 0:
            r.fetch_s_per_block = self._ewma(r.fetch_s_per_block, fetch_s / fetched_blocks)
        if sent_blocks > 0 and send_s > 0:
            r.transfer_s_per_block = self._ewma(r.transfer_s_per_block, send_s / sent_blocks)

    def observe_ttft(self, estimate: Estimate, x: Inputs, actual_s: float) -> None:
        """The measured time to first token of a request placed on `estimate`: the part the other terms do
        not explain becomes the option's overhead."""
        r = self.rates
        if estimate.option == "local_fetch" and estimate.fetch_blocks > 0:
            # D does not report its fetch: it is what the time to first token leaves after D's own overhead
            # (learned from its local prefills) and its compute
            compute = self._compute_s(x.queued_decode, estimate.compute_tokens, x.prompt_tokens)
            fetch_s = actual_s - self.overhead("local") - compute
            if fetch_s > 0:
                r.fetch_s_per_block = self._ewma(r.fetch_s_per_block, fetch_s / estimate.fetch_blocks)
            estimate = next(e for e in self.estimates(x) if e.option == "local_fetch")
        # An overhead moves from its prior by alpha, never jumps to one residual: early residuals also hold
        # the error of rates not learned yet (replayed over a logged workload, jumping doubled pd's estimates)
        old = self.overhead(estimate.option)
        explained = estimate.ttft_s - old
        r.overhead_s[estimate.option] = max(0.0, self._ewma(old, actual_s - explained))
        if estimate.option == "local":  # D's compute is seen only through its time to first token
            queued = x.queued_decode
            own = actual_s - self.overhead("local")
            if own > 0 and estimate.compute_tokens > 0:
                self.observe_prefill(x.prompt_tokens, estimate.compute_tokens + queued, own)
