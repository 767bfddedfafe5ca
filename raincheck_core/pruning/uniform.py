"""Uniform stride over the span (docs/selectors.md §7.1): the query-agnostic baseline needing no signal."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectionContext, Selector


def strided(n: int, keep: int, device: torch.device | str = "cpu") -> Tensor:
    """idx_k = floor((k + 0.5) * n / keep), k < keep: `keep` distinct sorted indices spread over [0, n)."""
    k = torch.arange(keep, device=device)
    # integer form of floor((k + 0.5) * n / keep), exact for any n
    return ((2 * k + 1) * n) // (2 * keep)


class UniformSelector(Selector):
    """Signals: only N. No fallback needed. Raster order, so video spans are covered frame by frame."""

    name = "uniform"

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        return strided(ctx.n, keep, ctx.device)
