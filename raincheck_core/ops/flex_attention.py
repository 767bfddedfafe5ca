"""Attention of a packed step on FlexAttention: one call per layer for all the step's rows.

The step's keys are the slots its segments read (their union, in slot order: a slot two segments read
is read once). Each layer reads them from the paged pool by slot id and runs one
`flex_attention` call whose block mask is the visibility rule of the step (ops/attention.py:
bottom-right causal over each segment's own readable list, which already leaves out what a deferred
chunk must not see, docs/mechanism.md §4). The mask is built once per step from the plan, as a dense
`[rows, keys]` table that the mask function reads, and shared by every layer.

Query rows and keys are padded to power-of-two buckets of at least `MIN_BUCKET`, so a compiled kernel
is compiled once per bucket pair and then reused by every step of that size; padded rows see nothing
(FlexAttention returns zeros for them) and their outputs are dropped. The compiled function is one per
process (`_compiled`): every engine, and every test, shares its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

MIN_BUCKET = 128
# one compiled kernel per (row bucket, key bucket, heads, dtype): more than dynamo's default of 8 per
# function when a process serves several models or shapes (the test suite)
RECOMPILE_LIMIT = 64


def bucket(n: int) -> int:
    """The padded size of `n` rows or keys: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


@dataclass
class FlexLayout:
    """Built once per step, read by every attention layer of the step."""

    write_slots: Tensor      # [R] the slot each packed row's K/V goes to
    keys: Tensor             # [Kp] the step's readable slot ids, padded with slot 0 (masked out)
    rows: int                # R, before padding
    padded_rows: int         # the row bucket
    visible: Tensor          # [rows bucket, keys bucket] True: the row sees the key (what the mask reads)
    block_mask: BlockMask


def flex_layout(q_lens: list[int], read_slots: list[Tensor], write_slots: Tensor,
                device: torch.device | str = "cpu") -> FlexLayout:
    """The layout of segments with `q_lens[s]` rows each (packed in order) reading `read_slots[s]` (own
    slots last, bottom-right causal), for a cache on `device`."""
    rows = sum(q_lens)
    cat = torch.cat([s.cpu() for s in read_slots])
    keys, rank = torch.unique(cat, sorted=True, return_inverse=True)
    rp, kp = bucket(rows), bucket(len(keys))
    visible = torch.zeros(rp, kp, dtype=torch.bool)
    row, at = 0, 0
    for n, slots in zip(q_lens, read_slots, strict=True):
        k = len(slots)
        # row i of the segment sees the first k - n + i + 1 of its readable slots
        limit = k - n + 1 + torch.arange(n)
        sees = torch.arange(k)[None, :] < limit[:, None]                    # [n, k]
        visible.index_put_(
            (torch.arange(row, row + n)[:, None].expand(n, k), rank[at:at + k][None].expand(n, k)), sees)
        row, at = row + n, at + k
    visible = visible.to(device)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return visible[q, kv]

    block_mask = create_block_mask(mask_mod, None, None, rp, kp, device=str(device))
    padded_keys = torch.zeros(kp, dtype=torch.long)
    padded_keys[:len(keys)] = keys
    return FlexLayout(write_slots.to(device), padded_keys.to(device), rows, rp, visible, block_mask)


def flex_varlen_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                          layout: FlexLayout) -> Tensor:
    """`varlen_attention` (ops/attention.py) on FlexAttention: write the step's `k, v [R, kv_heads, d]`
    into the cache, then attend `q [R, heads, d]` over the step's keys. Returns `[R, heads, d]`."""
    k_cache.index_copy_(0, layout.write_slots, k)
    v_cache.index_copy_(0, layout.write_slots, v)
    r, heads, d = q.shape
    qp = q.new_zeros(layout.padded_rows, heads, d)
    qp[:r] = q
    keys = k_cache.index_select(0, layout.keys).transpose(0, 1)[None]          # [1, kv, Kp, d]
    values = v_cache.index_select(0, layout.keys).transpose(0, 1)[None]
    out = _compiled()(qp.transpose(0, 1)[None], keys.to(q.dtype), values.to(q.dtype),
                      block_mask=layout.block_mask, enable_gqa=heads != keys.shape[1])
    return out[0, :, :r].transpose(0, 1)


@cache
def _compiled():
    """The process's compiled `flex_attention` (compiled on first use, per bucket shape)."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)
