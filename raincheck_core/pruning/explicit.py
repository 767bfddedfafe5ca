"""Caller-supplied selection: fixed indices, or a callable computed per span."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import InvalidInputError
from .base import SelectionContext, Selector, check_selection

IndexLike = Sequence[int] | Tensor
IndexFn = Callable[[SelectionContext, int], IndexLike]


class ExplicitSelector(Selector):
    """Signals: whatever the caller's function reads from the context; no fallback.

    `indices` is either a fixed index set or `fn(ctx, keep) -> indices`. The caller's output may be in
    any order (it is sorted); a wrong count, an out-of-range or a duplicate index raises
    InvalidInputError. As for every selector, keep >= N returns all indices without consulting it.
    """

    name = "explicit"

    def __init__(self, indices: IndexLike | IndexFn) -> None:
        super().__init__()
        self.indices = indices

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        raw = self.indices(ctx, keep) if callable(self.indices) else self.indices
        try:
            idx = torch.as_tensor(raw, device=ctx.device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidInputError(f"explicit selection: indices are not a list of ints ({e})") from e
        if idx.numel() == 0:
            idx = idx.long()  # an empty list becomes a float tensor
        return check_selection(idx, ctx.n, keep, "explicit selection")
