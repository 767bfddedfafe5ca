"""Split a turn's input into I0 (text/control + selected visual tokens) and D (the rest), both in
source order (docs/mechanism.md §2–3). Rows keep the positions they have in the full input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inputs import VisualInput
from ..multimodal.turn_input import TurnInput
from ..pruning import SelectionContext, get_selector, select_span
from .policy import DeferralConfig


@dataclass
class Partition:
    keep_rows: torch.Tensor       # I0: row indices into the turn input, ascending
    deferred_rows: torch.Tensor   # D: row indices, ascending (empty when nothing is deferred)


def partition_turn(turn: TurnInput, visuals: list[VisualInput], cfg: DeferralConfig, merge: int) -> Partition:
    n = len(turn)
    keep = torch.ones(n, dtype=torch.bool)
    if cfg.selects and turn.layout.spans:
        selector = get_selector(cfg.selector, **cfg.selector_options)
        visual_rows = torch.cat([s.token_indices for s in turn.layout.spans])
        text = torch.ones(n, dtype=torch.bool)
        text[visual_rows] = False
        # the question: every text/control row of this turn (selectors that use it embed-compare)
        query = turn.embeds[text.to(turn.embeds.device)].float()
        for span in turn.layout.spans:
            visual = visuals[span.index]
            t, h, w = visual.grid_thw
            ctx = SelectionContext(
                embeddings=visual.embeddings.float(), grid=(t, h // merge, w // merge),
                query=query if query.shape[0] else None,
                vision_features=visual.vision_features, attention_received=visual.attention_received,
            )
            chosen = select_span(selector, ctx, cfg.retention).cpu()
            dropped = torch.ones(len(span.token_indices), dtype=torch.bool)
            dropped[chosen] = False
            keep[span.token_indices[dropped]] = False
    rows = torch.arange(n)
    return Partition(rows[keep], rows[~keep])
