"""A turn's sampling parameters (OpenAI's and vLLM's fields), checked when built.

Parameters that cannot work are refused when `SamplingParams` is built (`InvalidInputError`): non-numbers,
NaN and infinities, negative values, a temperature between 0 and `MIN_TEMPERATURE` (1e-40 would overflow
the scaled logits), a top_p below `MIN_TOP_P` (1e-300 is 0 in fp32 and would cut every token). What they
do to the logits is the sampler's (sampling.py) and the logit rules' (logit_rules.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import InvalidInputError

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
