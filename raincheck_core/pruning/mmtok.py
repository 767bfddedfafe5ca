"""MMTok (docs/selectors.md §4): multimodal coverage maximisation by submodular greedy.

Signals: E (text-to-vision similarity), F (vision-to-vision similarity) and T, the question's raw
`embed_tokens` rows (the engine builds T from the first user turn; the reference's Qwen path embeds
"Question: " + q word by word). Fallbacks, flagged in `fallback_used`: no F -> E stands in for it
(a deviation from the method); no query (None or m = 0) -> the text part vanishes and
the selection is pure vision coverage, as in the reference.
Cost: a (m + N) x N matrix and `keep` greedy steps of O((m + N) N) each (plain, not lazy, greedy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SelectionContext, Selector, cosine_matrix


def coverage_matrix(e: Tensor, f: Tensor, t: Tensor | None, alpha: float = 0.5, tau_tv: float = 0.01,
                    tau_vv: float = 0.2) -> Tensor:
    """C = [P; alpha * Q]: rows are the items to cover (text tokens, then vision tokens), columns the
    N candidates. Each row is a softmax over candidates, scaled by 1/m (text) or 1/N (vision)."""
    n = e.shape[0]
    q = torch.softmax(cosine_matrix(f, f) / tau_vv, dim=1) / n
    if t is None or t.shape[0] == 0:
        return alpha * q
    p = torch.softmax(cosine_matrix(t, e) / tau_tv, dim=1) / t.shape[0]
    return torch.cat([p, alpha * q])


def greedy_order(c: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """Greedy maximisation of f(S) = sum_r max_{j in S} C[r, j]: the pick order and each pick's gain.

    gain[j] = sum_r relu(C[r, j] - cover[r]) equals f(S + j) - f(S), so the gains are the objective's
    increments (non-negative; their running sum is f along the greedy sequence).
    """
    cover = torch.zeros(c.shape[0], dtype=c.dtype, device=c.device)
    banned = torch.zeros(c.shape[1], dtype=torch.bool, device=c.device)
    order, gains = [], []
    for _ in range(keep):
        gain = (c - cover[:, None]).clamp_min_(0).sum(dim=0)
        gain[banned] = float("-inf")
        j = int(torch.argmax(gain))  # ties -> lowest index
        order.append(j)
        gains.append(gain[j])
        banned[j] = True
        cover = torch.maximum(cover, c[:, j])
    return torch.tensor(order, dtype=torch.long), torch.stack(gains) if gains else c.new_zeros(0)


class MMTokSelector(Selector):
    """Defaults are the Qwen ones: alpha 0.5, tau_tv 0.01 (LLaVA uses 0.02), tau_vv 0.2."""

    name = "mmtok"

    def __init__(self, alpha: float = 0.5, tau_tv: float = 0.01, tau_vv: float = 0.2) -> None:
        super().__init__()
        self.alpha, self.tau_tv, self.tau_vv = float(alpha), float(tau_tv), float(tau_vv)

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        f = ctx.vision_features
        if f is None:
            self.note_fallback("no vision features F; E stands in for vision-to-vision similarity")
            f = ctx.embeddings
        if ctx.query is None or ctx.query.shape[0] == 0:
            self.note_fallback("no query embeddings; pure vision coverage")
        c = coverage_matrix(ctx.embeddings, f, ctx.query, self.alpha, self.tau_tv, self.tau_vv)
        return greedy_order(c, keep)[0].sort().values
