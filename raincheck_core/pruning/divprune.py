"""DivPrune (docs/selectors.md §3): greedy max-min diversity over cosine distance.

Signals: E (default, as the official LLaVA code: LLM-input embeddings) or F (`features="vision"`,
MMTok's Qwen2.5-VL port). Query-agnostic. Fallback: `features="vision"` without F uses E, flagged.
Cost: an N x N distance matrix (4 MiB fp32 at N = 1024) and `keep` sequential O(N) steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InvalidInputError
from .base import SelectionContext, Selector, cosine_matrix


def divprune_order(x: Tensor, keep: int) -> Tensor:
    """Greedy farthest-point order (unsorted) of `keep` rows of x [N, d], 0 < keep < N.

    Keeps a running min distance to the chosen set (O(keep * N)) instead of the reference's
    recomputation over all chosen rows (O(keep^2 * N)); the picks are identical.
    """
    dist = 1.0 - cosine_matrix(x, x)
    dist.fill_diagonal_(float("inf"))
    # first pick: the token whose nearest neighbour is farthest (the reference's 2nd-smallest column entry)
    first = int(torch.argmax(dist.amin(dim=0)))
    order = [first]
    gap = dist[first].clone()
    # The published code relies on chosen tokens having gap 0 and can re-pick one when all
    # remaining gaps are 0 too (duplicates); mask chosen tokens with -inf as intended.
    gap[first] = float("-inf")
    for _ in range(keep - 1):
        j = int(torch.argmax(gap))  # ties -> lowest index
        order.append(j)
        gap = torch.minimum(gap, dist[j])  # -inf of earlier picks survives the min
        gap[j] = float("-inf")
    return torch.tensor(order, dtype=torch.long)


class DivPruneSelector(Selector):
    name = "divprune"

    def __init__(self, features: str = "embeddings") -> None:
        super().__init__()
        if features not in ("embeddings", "vision"):
            raise InvalidInputError(f"divprune features must be 'embeddings' or 'vision', got {features!r}")
        self.features = features

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        x = ctx.embeddings
        if self.features == "vision":
            if ctx.vision_features is None:
                self.note_fallback("no vision features F; using the embeddings E")
            else:
                x = ctx.vision_features
        return divprune_order(x, keep).sort().values
