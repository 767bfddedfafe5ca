"""VisionZip-Select (docs/selectors.md §6): the dominant tokens only, no contextual merging.

Signals: a^last, the attention received at the last ViT block (`ctx.attention_received["last"]`,
computed by `vit_attention`), which replaces the CLS attention that Qwen3-VL does not have.
Fallback: without it, the L2 norm of E (`base.attention_or_proxy`), flagged in `fallback_used`.
Selection is made at merged-token level from pooled scores; the Qwen2-VL port's patch-level selection
before the merger (which breaks the 2x2 grouping) is deliberately not copied.
"""

from __future__ import annotations

from torch import Tensor

from .base import SelectionContext, Selector, attention_or_proxy, top_indices


class VisionZipSelector(Selector):
    name = "visionzip"

    def __init__(self, layer: str = "last") -> None:
        super().__init__()
        self.layer = layer

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        return top_indices(attention_or_proxy(self, ctx, self.layer), keep).sort().values
