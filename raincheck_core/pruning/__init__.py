"""Visual-token selectors for the first prefill (docs/mechanism.md §2, docs/selectors.md).

A selector picks the tokens of one span that go into the first prefill; the others are deferred
(or dropped under the `hard` policy). `select_span` applies the budget rule of docs/mechanism.md §2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..errors import InvalidInputError
from .base import SelectionContext, Selector, check_selection
from .divprune import DivPruneSelector
from .explicit import ExplicitSelector
from .hiprune import HiPruneSelector
from .mmtok import MMTokSelector
from .query_topk import QueryTopKSelector
from .random import RandomSelector
from .uniform import UniformSelector
from .visionzip import VisionZipSelector
from .vit_attention import (
    attention_received_scores,
    default_layers,
    install_attention_capture,
    record_attention_received,
)

__all__ = [
    "SELECTORS", "DivPruneSelector", "ExplicitSelector", "HiPruneSelector", "MMTokSelector",
    "QueryTopKSelector", "RandomSelector", "SelectionContext", "Selector", "UniformSelector",
    "VisionZipSelector", "attention_received_scores", "check_selection", "default_layers", "get_selector",
    "install_attention_capture", "keep_count", "record_attention_received", "select_span",
]

SELECTORS: dict[str, Callable[..., Selector]] = {
    "mmtok": MMTokSelector,
    "hiprune": HiPruneSelector,
    "divprune": DivPruneSelector,
    "visionzip": VisionZipSelector,
    "uniform": UniformSelector,
    "query_topk": QueryTopKSelector,
    "random": RandomSelector,
    "explicit": ExplicitSelector,
}


def keep_count(n: int, retention: float) -> int:
    """Tokens kept in a span of n: n - floor((1 - r) * n) (docs/mechanism.md §2), for r in (0, 1].

    This is the binding rule, not the floor(r * n) of the published selectors: it rounds the kept count
    up, so any non-empty span keeps at least one token.
    """
    if isinstance(retention, bool) or not isinstance(retention, int | float) or not 0 < retention <= 1:
        raise InvalidInputError(f"retention must be a number in (0, 1], got {retention!r}")
    if n < 0:
        raise InvalidInputError(f"span size must be non-negative, got {n}")
    return n - math.floor((1 - retention) * n)


def get_selector(name: str, **options: Any) -> Selector:
    """A new selector by registry name; options go to its constructor (e.g. seed=, alpha=)."""
    if name not in SELECTORS:
        raise InvalidInputError(f"unknown selector {name!r}; valid names: {', '.join(sorted(SELECTORS))}")
    try:
        return SELECTORS[name](**options)
    except TypeError as e:  # an option the selector does not take
        raise InvalidInputError(f"bad options for selector {name!r}: {e}") from e


def select_span(selector: Selector, ctx: SelectionContext, retention: float) -> Tensor:
    """The sorted indices of the span's tokens for the first prefill: keep_count(N, retention) of them."""
    return selector.select(ctx, keep_count(ctx.n, retention))
