"""Attention over the paged KV cache for one segment (GQA through SDPA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    write_slots: torch.Tensor, read_slots: torch.Tensor | None, mask: torch.Tensor | None,
) -> torch.Tensor:
    """Write `k, v [n, kv_heads, d]` at `write_slots`, then attend `q [n, heads, d]` to `read_slots`.

    `read_slots=None`: the rows see only themselves, causally, so the new K/V are used directly (no
    gather). Otherwise `mask [n, len(read_slots)]` (True = visible; None = all). Returns `[n, heads, d]`.
    """
    k_cache[write_slots] = k
    v_cache[write_slots] = v
    if read_slots is None:
        keys, values = k, v
        causal = q.shape[0] > 1
    else:
        keys, values = k_cache[read_slots], v_cache[read_slots]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.transpose(0, 1)
