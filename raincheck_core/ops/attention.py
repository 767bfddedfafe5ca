"""Attention over the paged KV cache for one segment, with grouped-query heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many query rows (decode rows, fused deferred chunks) a grouped matmul beats SDPA, which
# would need K/V copied out to every query head; longer prefills take SDPA's fused kernel.
SMALL_QUERY_ROWS = 64


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    write_slots: torch.Tensor, read_slots: torch.Tensor | slice | None, mask: torch.Tensor | None,
) -> torch.Tensor:
    """Write `k, v [n, kv_heads, d]` at `write_slots`, then attend `q [n, heads, d]` to `read_slots`.

    `read_slots=None`: the rows see only themselves, causally, so the new K/V are used directly (no
    gather). A slice of read slots is a view of the cache, a tensor of slot ids a gather.
    `mask [n, len(read_slots)]` (True = visible; None = all). Returns `[n, heads, d]`.
    """
    k_cache.index_copy_(0, write_slots, k)
    v_cache.index_copy_(0, write_slots, v)
    n = q.shape[0]
    if read_slots is None:
        keys, values = k, v
        if n > 1:
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if n <= SMALL_QUERY_ROWS else None
    else:
        keys, values = k_cache[read_slots], v_cache[read_slots]
    if n <= SMALL_QUERY_ROWS:
        return _grouped_attention(q, keys, values, mask)
    # 4-D inputs with K/V expanded to the query heads take torch's fused CPU kernel; 3-D inputs or
    # enable_gqa fall back to the unfused math path (3-5x slower at 1k tokens).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], _expand_heads(keys, q.shape[1]), _expand_heads(values, q.shape[1]),
        attn_mask=mask, is_causal=read_slots is None,
    )
    return out[0].transpose(0, 1)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with the query heads of each KV head stacked as rows: no K/V copies."""
    n, heads, d = q.shape
    s, kv, _ = keys.shape
    rep = heads // kv
    qg = q.view(n, kv, rep, d).permute(1, 0, 2, 3).reshape(kv, n * rep, d)
    scores = torch.matmul(qg, keys.permute(1, 2, 0)).float() * d**-0.5        # [kv, n*rep, s]
    if mask is not None:
        row_mask = mask[:, None, :].expand(n, rep, s).reshape(n * rep, s)
        scores = scores.masked_fill(~row_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.transpose(0, 1))                         # [kv, n*rep, d]
    return out.view(kv, n, rep, d).permute(1, 0, 2, 3).reshape(n, heads, d)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[S, kv_heads, d]` -> `[1, heads, S, d]`; query head h reads kv head h // (heads / kv_heads)."""
    s, kv, d = x.shape
    if kv != heads:
        x = x[:, :, None].expand(s, kv, heads // kv, d).reshape(s, heads, d)
    return x.transpose(0, 1)[None]
