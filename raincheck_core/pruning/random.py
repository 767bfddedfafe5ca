"""Seeded random subset (docs/selectors.md §7.3): the noise floor."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectionContext, Selector


class RandomSelector(Selector):
    """Signals: only N. A fresh generator seeded with `seed` on every call, so the same span size and
    seed always give the same subset (the engine passes a per-request seed for variety)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = int(seed)

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        # CPU generator: the subset does not depend on the device the span lives on
        gen = torch.Generator().manual_seed(self.seed)
        return torch.sort(torch.randperm(ctx.n, generator=gen)[:keep]).values
