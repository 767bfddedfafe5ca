"""HiPrune (docs/selectors.md §5): anchors and buffers from a middle ViT layer, registers from the last.

Signals: a^middle (object-centric layer, default the ViT's middle block) and a^last, from
`ctx.attention_received["middle"]` / `["last"]` (`vit_attention`), plus the merged grid.
Fallback: a missing layer's score is replaced by the L2 norm of E (`base.attention_or_proxy`),
flagged in `fallback_used`; with both missing, anchors and registers rank by the same proxy.

The reference code's quirks are fixed: row-aware 4-neighbours that never wrap across a row
end or cross a video frame (the reference uses flat +-1 and clamps); anchors/buffers are excluded from
the registers by masking (the reference subtracts 1, which fails with query-sum scores); and an
anchor+buffer set larger than the budget is truncated (the reference asks for a negative top-k).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectionContext, Selector, attention_or_proxy, top_indices


def buffers(anchors: list[int], grid: tuple[int, int, int]) -> list[int]:
    """Left, right, up, down neighbours of each anchor inside its own frame, in anchor order."""
    _, hg, wg = grid
    out = []
    for a in anchors:
        frame, rest = divmod(a, hg * wg)
        r, c = divmod(rest, wg)
        for rr, cc in ((r, c - 1), (r, c + 1), (r - 1, c), (r + 1, c)):
            if 0 <= rr < hg and 0 <= cc < wg:
                out.append(frame * hg * wg + rr * wg + cc)
    return out


class HiPruneSelector(Selector):
    """alpha (default 0.1): budget share of anchors + buffers, i.e. round(alpha * keep / 5) anchors."""

    name = "hiprune"

    def __init__(self, alpha: float = 0.1, object_layer: str = "middle", deep_layer: str = "last") -> None:
        super().__init__()
        self.alpha, self.object_layer, self.deep_layer = float(alpha), object_layer, deep_layer

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        # a few hundred scalar picks: cheaper on the host than as device launches
        a_obj = attention_or_proxy(self, ctx, self.object_layer).cpu()
        a_deep = attention_or_proxy(self, ctx, self.deep_layer).cpu()
        n_anchor = min(keep, round(self.alpha * keep / 5))
        anchors = top_indices(a_obj, n_anchor).tolist()
        chosen = list(dict.fromkeys(anchors + buffers(anchors, ctx.grid)))  # ordered set
        if len(chosen) > keep:
            extra = torch.tensor(chosen[n_anchor:], dtype=torch.long)
            by_obj = extra[top_indices(a_obj[extra], extra.numel())]
            chosen = anchors + by_obj.tolist()[: keep - n_anchor]
        taken = torch.zeros(ctx.n, dtype=torch.bool)
        taken[chosen] = True
        rest = (~taken).nonzero().squeeze(1)
        registers = rest[top_indices(a_deep[rest], keep - len(chosen))]
        return torch.cat([torch.tensor(chosen, dtype=torch.long), registers]).sort().values
