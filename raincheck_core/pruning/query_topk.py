"""Query-similarity top-k (docs/selectors.md §7.2): text relevance without MMTok's coverage term."""

from __future__ import annotations

from torch import Tensor

from .base import SelectionContext, Selector, cosine_matrix, top_indices
from .uniform import strided


class QueryTopKSelector(Selector):
    """Signals: E and the question's `embed_tokens` rows T.

    score_j = max_i cos(T_i, E_j) (max-pooled over text tokens), top-`keep` with lowest-index ties.
    Fallback: no query (None or zero rows) -> uniform stride, flagged in `fallback_used`.
    """

    name = "query_topk"

    def _select(self, ctx: SelectionContext, keep: int) -> Tensor:
        if ctx.query is None or ctx.query.shape[0] == 0:
            self.note_fallback("no query embeddings; using the uniform stride")
            return strided(ctx.n, keep, ctx.device)
        score = cosine_matrix(ctx.query, ctx.embeddings).amax(dim=0)
        return top_indices(score, keep).sort().values
