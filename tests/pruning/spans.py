"""Synthetic spans for the selector tests."""

from __future__ import annotations

import torch

from raincheck_core.pruning import SelectionContext


def make_ctx(grid: tuple[int, int, int] = (1, 4, 7), d: int = 16, m: int | None = 3, d_v: int | None = 8,
             attention: bool = True, seed: int = 0) -> SelectionContext:
    """A span with every signal (or, with m/d_v None and attention False, only the embeddings)."""
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2]
    return SelectionContext(
        embeddings=torch.randn(n, d, generator=g),
        grid=grid,
        query=None if m is None else torch.randn(m, d, generator=g),
        vision_features=None if d_v is None else torch.randn(n, d_v, generator=g),
        attention_received=None if not attention else {
            "middle": torch.rand(n, generator=g), "last": torch.rand(n, generator=g)},
    )
