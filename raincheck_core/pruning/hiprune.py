"""HiPrune (docs/selectors.md §5): anchors and buffers from a middle ViT layer, registers from the last.

Signals: a^middle (object-centric layer, default the ViT's middle block) and a^last, from
`ctx.attention_received["middle"]` / `["last"]` (`vit_attention`), plus the merged grid.
Fallback: a missing layer's score is replaced by the L2 norm of E (`base.attention_or_proxy`),
flagged in `fallback_used`; with both missing, anchors and registers rank by the same proxy.

The reference code's quirks are fixed: row-aware 4-neighbours that never wrap across a row
end or cross a video frame (the reference uses flat +-1 and clamps); anchors/buffers are excluded from
the registers by masking (the reference subtracts 1, which fails with query-sum scores); and an
anchor+buffer set larger than the budget is truncated (the reference asks for a negative top-k).

Which layer plays which role is a per-model hyperparameter (the paper calibrates it per vision encoder):
the defaults are the paper's rule for deep towers (object layer = the middle block, deep layer = the last),
and `calibrated_layers` applies the paper's calibration statistic (`spatial_spread`) to a tower's measured
scores; a checkpoint can ship the result as selector options (`pruning.settings`).
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


def spatial_spread(score: Tensor, grid: tuple[int, int, int], share: float = 0.1) -> float:
    """HiPrune's layer-calibration statistic: the mean pairwise distance (in merged-grid cells) between the
    top `share` of tokens by `score`, pairs within one frame. Object-centric layers concentrate their
    attention, so the object layer is the one with the smallest spread."""
    _, hg, wg = grid
    top = top_indices(score, max(2, round(share * score.numel())))
    frame, cell = top // (hg * wg), top % (hg * wg)
    points = torch.stack([cell // wg, cell % wg], dim=1).float()
    same = (frame[:, None] == frame[None, :]).float() - torch.eye(len(top))
    pairs = same.sum()
    return float((torch.cdist(points, points) * same).sum() / pairs) if pairs else 0.0


def calibrated_layers(spread: dict[str, float], deep_default: str = "last") -> dict[str, str]:
    """Selector options {object_layer, deep_layer} from each recorded layer's mean `spatial_spread`: the
    most concentrated layer is the object layer; the deep layer stays `deep_default` unless that is the
    object layer, in which case it is the most spread-out other layer (a tower too shallow for the paper's
    middle/last hierarchy, e.g. two blocks)."""
    if len(spread) < 2:
        raise ValueError(f"calibration needs scores of at least two layers, got {sorted(spread)}")
    obj = min(spread, key=spread.__getitem__)
    others = {k: v for k, v in spread.items() if k != obj}
    deep = deep_default if deep_default in others else max(others, key=others.__getitem__)
    return {"object_layer": obj, "deep_layer": deep}


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
