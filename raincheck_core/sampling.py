"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, min-p, seeded), with the
per-turn logit rules of logit_rules.py (bias, penalties, min_tokens) and the chosen token's logprobs.

Parameters that cannot work are refused when `SamplingParams` is built (`InvalidInputError`): non-numbers,
NaN and infinities, negative values, a temperature between 0 and `MIN_TEMPERATURE` (1e-40 would overflow
the scaled logits), a top_p below `MIN_TOP_P` (1e-300 is 0 in fp32 and would cut every token).

The sampler never crashes on what the model gives it: NaN logits are treated as -inf (that token cannot
be drawn) and +inf or unusable probabilities fall back to greedy, which `Sampler.fallback` records. Only
logits with no finite value at all (nothing to choose from) raise `SamplingError`, for that turn alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .errors import InvalidInputError, SamplingError
from .logit_rules import LogitRules, token_logprobs

if TYPE_CHECKING:
    from .grammar import TokenConstraint

log = logging.getLogger(__name__)
MIN_TEMPERATURE = 1e-5   # below it, sampling is greedy in all but name; 0 asks for greedy
MIN_TOP_P = 1e-6         # below it top_p keeps only the most likely token (any vocabulary up to 1M)
MAX_TOP_LOGPROBS = 20    # OpenAI's limit
MAX_LOGIT_BIAS = 100.0   # OpenAI's limit (either sign)
MAX_N = 128              # OpenAI's limit of answers per request


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy; else at least MIN_TEMPERATURE
    top_p: float = 1.0                # in [MIN_TOP_P, 1]
    top_k: int = 0                    # 0 = no top-k cut
    seed: int | None = None           # any integer (taken modulo 2**64)
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False          # keep going past the model's stop tokens (benchmarks)
    presence_penalty: float = 0.0     # in [-2, 2]
    frequency_penalty: float = 0.0    # in [-2, 2]
    repetition_penalty: float = 1.0   # > 0; 1 = none
    min_p: float = 0.0                # in [0, 1]: drop tokens below min_p x the most likely one's probability
    min_tokens: int = 0               # the stop tokens cannot end the answer before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100])
    logprobs: bool = False            # report each chosen token's log probability
    top_logprobs: int = 0             # and the k most likely tokens' (needs logprobs)
    grammar: str | None = None        # llguidance grammar text the answer must follow (grammar.py)
    n: int = 1                        # answers to the prompt, sharing its prefill (docs/mechanism.md §12)

    def __post_init__(self) -> None:
        temperature = _number("temperature", self.temperature)
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            raise InvalidInputError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                    f"got {temperature:g}")
        top_p = _number("top_p", self.top_p)
        if not MIN_TOP_P <= top_p <= 1:
            raise InvalidInputError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {top_p:g}")
        if _integer("top_k", self.top_k) < 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None:
            _integer("seed", self.seed)
        if _integer("max_new_tokens", self.max_new_tokens) < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= _integer("n", self.n) <= MAX_N:
            raise InvalidInputError(f"n must be in [1, {MAX_N}], got {self.n}")
        for token in self.stop_token_ids:
            if _integer("a stop token id", token) < 0:
                raise InvalidInputError(f"stop token ids must be >= 0, got {token}")
        self._check_rules()

    def _check_rules(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= _number(name, getattr(self, name)) <= 2:
                raise InvalidInputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidInputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise InvalidInputError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= _integer("min_tokens", self.min_tokens) <= self.max_new_tokens:
            raise InvalidInputError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                                    f"got {self.min_tokens}")
        for token, bias in self.logit_bias:
            if _integer("a logit_bias token id", token) < 0:
                raise InvalidInputError(f"logit_bias token ids must be >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= _number("a logit_bias value", bias) <= MAX_LOGIT_BIAS:
                raise InvalidInputError(f"logit_bias values must be in [-100, 100], got {bias} for {token}")
        if not 0 <= _integer("top_logprobs", self.top_logprobs) <= MAX_TOP_LOGPROBS:
            raise InvalidInputError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidInputError("top_logprobs needs logprobs")
        if self.grammar is not None:
            if not isinstance(self.grammar, str):
                raise InvalidInputError(f"grammar must be a string, got {type(self.grammar).__name__}")
            # a grammar's answer ends at the stop token when the grammar is complete, and not before
            if self.ignore_eos or self.min_tokens:
                raise InvalidInputError("a grammar decides where the answer ends: ignore_eos and min_tokens "
                                        "cannot be set with it")

    def branch(self, i: int) -> SamplingParams:
        """The parameters of answer `i` of an `n > 1` turn: one answer, with seed + i when a seed is set (so
        that seeded answers differ from each other and each is reproducible)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + i)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
        self.logprob: float | None = None
        self.top_logprobs: tuple[tuple[int, float], ...] = ()
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed % 2**64)
        else:
            self.generator.seed()
        self.fallback: str | None = None     # what the latest draw did differently from what was asked
        self._warned: set[str] = set()

    def __call__(self, logits: torch.Tensor) -> int:
        self.fallback = None
        raw = logits.detach().float()
        ruled = self.rules.apply(raw) if self.rules is not None else raw
        if self.constraint is not None:
            ruled = self.constraint.apply(ruled.clone() if ruled is raw else ruled)
        token = self._draw(ruled)
        if self.rules is not None:
            self.rules.record(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.params.logprobs:
            self.logprob, self.top_logprobs = token_logprobs(raw, token, self.params.top_logprobs)
        return token

    def _draw(self, logits: torch.Tensor) -> int:
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
