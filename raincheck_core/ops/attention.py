"""Attention of a packed step over the paged KV cache: every segment of every sequence in one call.

A step packs the rows of many sequences (prefill chunks, decode rows, deferred chunks) one after
another. Each segment names the cache slots it may read — its visible past followed by its own new
slots — and sees them *bottom-right causally*: row i of an n-row segment with k readable slots sees the
first k - n + i + 1 of them. That one rule covers a first prefill (k = n), a continued prefill, a
decode row (sees everything) and a deferred chunk (its readable list simply leaves out the slots it
must not see; docs/mechanism.md §4).

`AttentionLayout` is built once per step and shared by all attention layers. On the CPU, segments of up
to 64 rows (decode rows, deferred and short prefill chunks) run in one call of the native paged kernel
(ops/csrc/paged_attention.c, called through ops/paged_attention.py), which reads K/V in place through the
slot lists; longer prefills, and every segment where the step's op set has no kernel (ops/backend.py),
are grouped by query length and each group runs as one padded batched call. A GPU backend would run one
varlen paged kernel over the same layout. A group of one segment whose readable slots are consecutive (a
lone session's pages, which the pool hands out in order) reads K/V as a strided view of the cache;
otherwise they are gathered into one padded copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .paged_attention import PagedSegments, paged_attention, paged_segments

# Up to this many query rows per segment a grouped matmul beats SDPA, which would need K/V copied out
# to every query head; longer prefills take SDPA's fused kernel.
SMALL_QUERY_ROWS = 64


@dataclass
class AttentionGroup:
    """Segments of similar query length, padded to `[N, q_max]` queries and `[N, k_max]` keys."""

    rows: torch.Tensor              # [N * q_max] packed row of each padded query (0 for padding)
    real: torch.Tensor              # [R_g] positions in the padded [N * q_max] that are real rows
    real_rows: torch.Tensor         # [R_g] the packed rows they are
    keys: torch.Tensor              # [N, k_max] readable slot ids (0 for padding)
    mask: torch.Tensor | None       # [N, q_max, k_max] True = visible; None = all visible
    q_max: int
    causal_self: bool = False       # one segment reading only its own rows (a first prefill): no gather
    span: tuple[int, int] | None = None  # one segment reading slots [a, b) in order: a view, no gather
    # what every layer's gather of this group reuses: the rows of the flat `[slots * kv, d]` cache to
    # read, and the buffers K and V are gathered into (built by the first layer)
    gather_rows: torch.Tensor | None = field(default=None, repr=False)
    buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


@dataclass
class AttentionLayout:
    """Built once per step, read by every attention layer of the step (one layer at a time: the gather
    buffers a group holds are reused by the next layer)."""

    write_slots: torch.Tensor       # [R] the slot each packed row's K/V goes to
    groups: list[AttentionGroup]
    paged: PagedSegments | None = None   # segments the native kernel runs (none of them in `groups`)


def attention_layout(q_lens: list[int], read_slots: list[torch.Tensor], write_slots: torch.Tensor,
                     device: torch.device | str = "cpu", pool: object | None = None, *,
                     native: bool) -> AttentionLayout:
    """The layout of segments with `q_lens[s]` rows each (packed in order) reading `read_slots[s]`
    (their own slots last), for a cache on `device` (`pool`, which the FlexAttention layout reads in
    place, is not needed: these read through the slot lists). `native`: run the segments of up to
    `SMALL_QUERY_ROWS` rows with the native paged kernel (the step's op set says whether it may, see
    ops/backend.py); longer ones take SDPA or the batched matmuls."""
    starts, row = [], 0
    for n in q_lens:
        starts.append(row)
        row += n
    small = [s for s, n in enumerate(q_lens) if n == 1]
    medium = [s for s, n in enumerate(q_lens) if 1 < n <= SMALL_QUERY_ROWS]
    large = [s for s, n in enumerate(q_lens) if n > SMALL_QUERY_ROWS]
    paged = None
    if native and (small or medium):
        paged = paged_segments(sorted(small + medium), q_lens, starts, read_slots)
        small, medium = [], []
    groups = [_group(ids, q_lens, starts, read_slots, device) for ids in (small, medium, large) if ids]
    return AttentionLayout(write_slots.to(device), groups, paged)


def _group(ids: list[int], q_lens: list[int], starts: list[int], read_slots: list[torch.Tensor],
           device: torch.device | str) -> AttentionGroup:
    n = len(ids)
    q = torch.tensor([q_lens[s] for s in ids])
    k = torch.tensor([len(read_slots[s]) for s in ids])
    q_max, k_max = int(q.max()), int(k.max())
    qi = torch.arange(q_max)
    real_q = qi[None, :] < q[:, None]                                       # [N, q_max]
    rows = (torch.tensor([starts[s] for s in ids])[:, None] + qi[None, :]) * real_q
    keys = torch.nn.utils.rnn.pad_sequence([read_slots[s] for s in ids], batch_first=True)
    causal_self = n == 1 and int(k[0]) == int(q[0]) and q_max > SMALL_QUERY_ROWS
    mask = None
    if not causal_self and (q_max > 1 or bool((k != k_max).any())):
        # row i of a segment sees keys [0, k - q + i + 1); padded query rows see key 0 (no NaN)
        limit = (k - q)[:, None] + qi[None, :] + 1                          # [N, q_max]
        limit = torch.where(real_q, limit, torch.ones_like(limit))
        mask = torch.arange(k_max)[None, None, :] < limit[:, :, None]
    flat_real = real_q.flatten().nonzero().flatten()
    return AttentionGroup(
        rows=rows.flatten().to(device), real=flat_real.to(device), real_rows=rows.flatten()[flat_real].to(device),
        keys=keys.to(device), mask=mask.to(device) if mask is not None else None, q_max=q_max,
        causal_self=causal_self, span=_span(read_slots[ids[0]]) if n == 1 and not causal_self else None,
    )


def _span(slots: torch.Tensor) -> tuple[int, int] | None:
    """`(a, b)` if `slots` is exactly a, a+1, ..., b-1."""
    a = int(slots[0])
    if bool(torch.equal(slots, torch.arange(a, a + slots.shape[0], device=slots.device))):
        return a, a + slots.shape[0]
    return None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """Write the step's `k, v [R, kv_heads, d]` into the cache, then attend `q [R, heads, d]` per the
    layout. Returns `[R, heads, d]`."""
    k_cache.index_copy_(0, layout.write_slots, k)
    v_cache.index_copy_(0, layout.write_slots, v)
    out = torch.empty_like(q)
    heads, d = q.shape[1], q.shape[2]
    if layout.paged is not None:
        paged_attention(q.contiguous(), k_cache, v_cache, out, layout.paged)
    for g in layout.groups:
        n = g.keys.shape[0]
        if g.causal_self:
            rows = g.real_rows
            res = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], _expand_heads(k[rows], heads), _expand_heads(v[rows], heads),
                is_causal=True)
            out[rows] = res[0].transpose(0, 1)
            continue
        qg = q[g.rows].view(n, g.q_max, heads, d)
        if g.q_max <= SMALL_QUERY_ROWS:
            res = _grouped_attention(qg, *_read_heads(k_cache, v_cache, g), g.mask)
        else:
            keys, values = _read_rows(k_cache, g), _read_rows(v_cache, g)   # [N, k_max, kv, d]
            mask = g.mask[:, None] if g.mask is not None else None
            res = F.scaled_dot_product_attention(
                qg.transpose(1, 2), _expand_heads(keys, heads), _expand_heads(values, heads), attn_mask=mask,
            ).transpose(1, 2)
        out[g.real_rows] = res.reshape(n * g.q_max, heads, d)[g.real]
    return out


def _read_heads(k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[slots, kv, d]` read at the group's keys as `[N, kv, s, d]`: strided views of a span, else
    gathers straight into the layout the batched matmuls read without another copy. The gather rows and
    buffers are built once per step: a fresh multi-MB buffer per layer costs page faults that, at 32
    decode rows, took about as long as the copy itself."""
    if g.span is not None:
        a, b = g.span
        return k_cache[a:b].transpose(0, 1)[None], v_cache[a:b].transpose(0, 1)[None]
    keys = g.keys
    kv, d = k_cache.shape[1], k_cache.shape[2]
    if g.gather_rows is None:
        g.gather_rows = (keys[:, None, :] * kv + torch.arange(kv, device=keys.device)[None, :, None]).flatten()
    rows = g.gather_rows
    if g.buffers is None or g.buffers[0].dtype != k_cache.dtype:
        g.buffers = (k_cache.new_empty(len(rows), d), v_cache.new_empty(len(rows), d))
    shape = (keys.shape[0], kv, keys.shape[1], d)
    return tuple(torch.index_select(cache.view(-1, d), 0, rows, out=buf).view(shape)
                 for cache, buf in zip((k_cache, v_cache), g.buffers, strict=True))


def _read_rows(cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """`cache [slots, kv, d]` read at the group's keys as `[N, s, kv, d]` (a view of a span)."""
    if g.span is not None:
        return cache[g.span[0]:g.span[1]][None]
    return cache.index_select(0, g.keys.flatten()).view(*g.keys.shape, *cache.shape[1:])


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with the query heads of each KV head stacked as rows: no K/V copies per head.
    q `[N, n, heads, d]`, keys/values `[N, kv, s, d]`, mask `[N, n, s]`; returns `[N, n, heads, d]`."""
    b, n, heads, d = q.shape
    kv, s = keys.shape[1], keys.shape[2]
    rep = heads // kv
    qg = q.view(b, n, kv, rep, d).permute(0, 2, 1, 3, 4).reshape(b, kv, n * rep, d)
    # 4-D matmuls: K/V may be strided views of the cache (BLAS reads them with a leading dimension)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * d**-0.5                 # [N, kv, n*rep, s]
    if mask is not None:
        row_mask = mask[:, None, :, None, :].expand(b, kv, n, rep, s).reshape(b, kv, n * rep, s)
        scores = scores.masked_fill(~row_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)                                                   # [N, kv, n*rep, d]
    return out.view(b, kv, n, rep, d).permute(0, 2, 1, 3, 4).reshape(b, n, heads, d)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[..., S, kv_heads, d]` -> `[..., heads, S, d]`; query head h reads kv head h // (heads / kv_heads)."""
    kv, d = x.shape[-2:]
    if kv != heads:
        x = x.unsqueeze(-2).expand(*x.shape[:-1], heads // kv, d).reshape(*x.shape[:-2], heads, d)
    return x.transpose(-3, -2) if x.dim() == 4 else x.transpose(0, 1)[None]


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        read_slots: torch.Tensor) -> torch.Tensor:
    """Slow reference for tests: one segment's rows `q [n, heads, d]` over `read_slots` (own last),
    bottom-right causal, in fp32 with explicit softmax."""
    n, heads, d = q.shape
    keys, values = k_cache[read_slots].float(), v_cache[read_slots].float()
    rep = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), keys) * d**-0.5
    s = keys.shape[0]
    visible = torch.arange(s)[None, :] < (s - n + torch.arange(n) + 1)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), values)
