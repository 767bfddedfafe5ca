"""The sampler (greedy, temperature, top-k, top-p, min-p, seeded), with the per-turn logit rules of
logit_rules.py (bias, penalties, min_tokens) and the chosen token's logprobs; its parameters are
sampling_params.py's `SamplingParams`.

The sampler never crashes on what the model gives it: NaN logits are treated as -inf (that token cannot
be drawn) and +inf or unusable probabilities fall back to greedy, which `Sampler.fallback` records. Only
logits with no finite value at all (nothing to choose from) raise `SamplingError`, for that turn alone.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import SamplingError
from .logit_rules import LogitRules, token_logprobs
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .grammar import TokenConstraint

log = logging.getLogger(__name__)


def row_maxima(logits: torch.Tensor) -> list[tuple[float, int]]:
    """Each row's largest logit and the index of its first occurrence (as `torch.argmax` picks; a NaN is
    the largest), for a step's `[rows, vocab]` logits in one reduction instead of one per row. On the CPU
    through numpy, whose argmax is vectorised: torch's reduction with indices is 6x slower on one thread
    (64 rows of a 152K vocabulary: 9.4 ms against 2.1)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        rows = logits.detach().numpy()
        indices = rows.argmax(axis=1)
        values = rows[np.arange(rows.shape[0]), indices]
        return list(zip(values.tolist(), indices.tolist(), strict=True))
    values, indices = logits.max(dim=-1)
    return list(zip(values.tolist(), indices.tolist(), strict=True))


class Sampler:
    """Draws one token from the logits `[vocab]`; owns the turn's random generator and logit rules.

    `context`: the turn's input tokens (the repetition penalty's); `stop_ids`: the tokens that end the
    answer (held back until `min_tokens`); `constraint`: the turn's grammar, which masks what it cannot
    take next. After each draw, `logprob` / `top_logprobs` hold the chosen token's log probability under
    the model's logits, before any rule or mask (with `params.logprobs`)."""

    def __init__(self, params: SamplingParams, context: list[int] | tuple[int, ...] = (),
                 stop_ids: set[int] | frozenset[int] = frozenset(), constraint: TokenConstraint | None = None):
        self.params = params
        self.rules = LogitRules(params, context, stop_ids) if LogitRules.needed(params) else None
        self.constraint = constraint
        # greedy with no rule, grammar or logprobs: the draw is the row's first largest logit (fixed for the
        # sampler's life, and read for every decode row)
        self.plain_greedy = params.greedy and self.rules is None and constraint is None and not params.logprobs
        self.logprob: float | None = None
        self.top_logprobs: tuple[tuple[int, float], ...] = ()
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed % 2**64)
        else:
            self.generator.seed()
        self.fallback: str | None = None     # what the latest draw did differently from what was asked
        self._warned: set[str] = set()

    def from_maximum(self, maximum: tuple[float, int]) -> int | None:
        """The draw, when the row's largest logit and its index (`row_maxima`, found for a whole step at
        once) decide it: a plain greedy draw on finite logits; None: call the sampler on the row."""
        if self.plain_greedy and math.isfinite(maximum[0]):
            self.fallback = None
            return maximum[1]
        return None

    def __call__(self, logits: torch.Tensor, draft: int | None = None) -> int:
        """The next token. `draft`: a token a deterministic drafter proposed for this row (speculative
        decoding): a greedy draw ignores it (the caller compares); a sampled one accepts it with its
        probability p(draft) and otherwise draws from p without it, renormalized, which leaves the
        distribution of the result exactly p (rejection sampling against a point-mass proposal)."""
        self.fallback = None
        raw = logits.detach().float()
        ruled = self.rules.apply(raw) if self.rules is not None else raw
        if self.constraint is not None:
            ruled = self.constraint.apply(ruled.clone() if ruled is raw else ruled)
        token = self._draw(ruled, draft)
        if self.rules is not None:
            self.rules.record(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.params.logprobs:
            self.logprob, self.top_logprobs = token_logprobs(raw, token, self.params.top_logprobs)
        return token

    def _draw(self, logits: torch.Tensor, draft: int | None = None) -> int:
        top = float(logits.max())            # NaN if any is NaN; +inf if any is +inf
        if math.isnan(top):
            logits = logits.masked_fill(torch.isnan(logits), float("-inf"))
            top = float(logits.max())
            self._note("NaN logits left out")
        if top == -math.inf:
            raise SamplingError(f"the model gave no usable logit (all {logits.numel()} are NaN or -inf): "
                                "no token can be chosen")
        if top == math.inf:
            return self._greedy(logits, "+inf logits")
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self._probs(logits.cpu(), top)
        total = float(probs.sum())
        if not (math.isfinite(total) and total > 0):
            return self._greedy(logits, "no probability mass left")
        if draft is not None:
            if float(torch.rand((), generator=self.generator)) * total < float(probs[draft]):
                return draft
            probs = probs.clone()
            probs[draft] = 0.0      # the residual max(p - q, 0) of a point mass q at the draft
            if not float(probs.sum()) > 0:
                return draft
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _probs(self, logits: torch.Tensor, top: float) -> torch.Tensor:
        p = self.params
        # subtract the max first: the largest scaled logit is 0, so no temperature can overflow it
        scaled = (logits - top) / p.temperature
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs

    def _greedy(self, logits: torch.Tensor, reason: str) -> int:
        self._note(f"{reason}: greedy")
        return int(torch.argmax(logits))

    def _note(self, what: str) -> None:
        self.fallback = what if self.fallback is None else f"{self.fallback}; {what}"
        if what not in self._warned:      # once per turn and kind, not once per token
            self._warned.add(what)
            log.warning("sampling: %s", what)
