"""How an engine speculates: which drafter proposes, how many tokens per step, the n-gram window."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` None: off (the default). "ngram": prompt lookup over the session's history (any family);
    "mtp": the checkpoint's multi-token-prediction head (Qwen3.5 only). `num_tokens` k: drafts verified
    per step (a verify segment of k + 1 rows). The n-gram drafter matches the history's last
    `ngram_max` .. `ngram_min` tokens, longest first, against earlier text, looking back at most
    `ngram_window` tokens (bounds the search on long sessions)."""

    method: str | None = None
    num_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_window: int = 4096

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise InvalidInputError(f"speculative method must be one of {list(METHODS)} or None, got {self.method!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max", "ngram_window"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"speculative {name} must be positive, got {getattr(self, name)}")
        if self.ngram_min > self.ngram_max:
            raise InvalidInputError(f"speculative ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")

    @property
    def enabled(self) -> bool:
        return self.method is not None
