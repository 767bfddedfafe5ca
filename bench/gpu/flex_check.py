"""FlexAttention over the paged pool on its own, before any engine step relies on it (issue 39): each kind of
query group the layout makes (decode rows, a few-row group on the decoding kernel, 16-row tiles on the main
kernel, a deferred chunk that skips its turn's generated slots, a long prefill) against the fp32 reference,
in bf16 at a real model's heads (GQA 4) and in fp32 at three query heads per KV head (the main kernel for
every group); then decode steps of B sessions over their own pages, timed, with the K/V bytes they may read
per second set against the copy bandwidth (a decode step's attention is a read of those bytes)."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
from torch import Tensor

from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.ops.attention import reference_attention
from raincheck_core.ops.attention_accounting import flex_accounting
from raincheck_core.ops.flex_attention import flex_varlen_attention
from raincheck_core.ops.flex_layout import FlexLayout, flex_layout

from .timing import sync, timed

PAGE = 16
# (name, dtype, query heads, KV heads, head dim): Qwen3-VL-8B's attention, and a GQA no power of two divides
CASES = (("bf16_gqa4", torch.bfloat16, 32, 8, 128), ("fp32_gqa3", torch.float32, 6, 2, 64))
# (context already in the cache, rows this step): decode rows, a 3-row group, 16- and 31-row chunks, a prefill
SEGMENTS = ((700, 1), (90, 1), (33, 3), (100, 16), (600, 31), (0, 300))
GENERATED = 40          # the 31-row chunk's session: its last this-many slots are generated tokens it skips


def _pool(pages: int, kv_heads: int, d: int, dtype: torch.dtype, device: str) -> KVPool:
    pool = KVPool(1, pages, PAGE, kv_heads, d, dtype, device)
    pool.k.normal_()
    pool.v.normal_()
    return pool


def _step(pool: KVPool, segments: tuple[tuple[int, int], ...], skip: int | None = None
          ) -> tuple[list[int], list[Tensor], Tensor, list[np.ndarray]]:
    """Each (context, rows) segment a session of its own: (q_lens, readable slots, slots written, each
    session's page table's pages); the segment at index `skip` reads its context without its last GENERATED
    slots (a deferred chunk)."""
    q_lens, reads, writes, pages = [], [], [], []
    for i, (context, n) in enumerate(segments):
        table = PageTable(pool, (context + n) // PAGE + 2)
        table.append(context)
        write = table.ahead(0, n)
        past = table.reserved_slots(0, context)
        if i == skip:
            past = past[:context - GENERATED]
        q_lens.append(n)
        reads.append(torch.cat([past, write]))
        writes.append(write)
        pages.append(table.page_ids)
    return q_lens, reads, torch.cat(writes), pages


def _call(pool: KVPool, q_lens: list[int], reads: list[Tensor], writes: Tensor, heads: int, device: str
          ) -> tuple[Tensor, FlexLayout, Tensor]:
    rows, (kv_heads, d) = sum(q_lens), pool.k.shape[2:]
    q = torch.randn(rows, heads, d, device=device, dtype=pool.k.dtype)
    k, v = (torch.randn(rows, kv_heads, d, device=device, dtype=pool.k.dtype) for _ in range(2))
    layout = flex_layout(q_lens, reads, writes, device, pool)
    return q, layout, flex_varlen_attention(q, k, v, pool.k[0], pool.v[0], layout)


def groups(device: str, tiny: bool) -> dict:
    """{case: {error per segment (max |x - ref| / max |ref|), the query buckets, first call s}} (tiny, the
    CPU dry run: the fp32 case without the prefill, each compile being most of its time)."""
    out = {}
    for name, dtype, heads, kv_heads, d in CASES[1:] if tiny else CASES:
        pool = _pool(256, kv_heads, d, dtype, device)
        q_lens, reads, writes, _ = _step(pool, SEGMENTS[:-1] if tiny else SEGMENTS, skip=4)
        sync(device)
        t0 = time.perf_counter()
        q, layout, res = _call(pool, q_lens, reads, writes, heads, device)
        sync(device)
        first = time.perf_counter() - t0
        errors, at = [], 0
        for s, n in enumerate(q_lens):
            ref = reference_attention(q[at:at + n], pool.k[0], pool.v[0], reads[s].to(device))
            errors.append(float((res[at:at + n].float() - ref).abs().max() / ref.abs().max()))
            at += n
        out[name] = dict(errors=errors, max_error=max(errors), buckets=[g.q for g in layout.groups], first_s=first,
                         finite=bool(torch.isfinite(res).all()))
    return out


def decode(device: str, tiny: bool, bandwidth: float | None = None) -> list[dict]:
    """Decode steps of B sessions over `context` tokens each (bf16, the first case's heads; tiny: the fp32
    case's): per B, the call's time (best of 20, the step's K/V write and query gather included), the
    layout's host time, the K/V bytes it may read per second and, with `bandwidth` (bytes/s, reads plus
    writes of a copy), that rate over it."""
    _, dtype, heads, kv_heads, d = CASES[-1] if tiny else CASES[0]
    sizes, context = ((1, 4), 64) if tiny else ((1, 16, 64), 4096)
    rows = []
    for b in sizes:
        pool = _pool(b * (context // PAGE + 2) + 8, kv_heads, d, dtype, device)
        q_lens, reads, writes, pages = _step(pool, ((context, 1),) * b)
        q, layout, _ = _call(pool, q_lens, reads, writes, heads, device)
        k, v = (torch.randn(b, kv_heads, d, device=device, dtype=dtype) for _ in range(2))
        seconds = timed(partial(flex_varlen_attention, q, k, v, pool.k[0], pool.v[0], layout), device, 20)
        # as the engine builds a decode step's: its lists are page-table prefixes, its rows carry their pages
        t0 = time.perf_counter()
        flex_layout(q_lens, reads, writes, device, pool, prefixes=[True] * b, pages=pages)
        layout_s = time.perf_counter() - t0
        acc = flex_accounting(layout, kv_heads, d, pool.k.element_size())
        rate = acc.kv_visible / seconds
        rows.append(dict(sessions=b, context=context, ms=1e3 * seconds, layout_host_ms=1e3 * layout_s,
                         kv_visible_mb=acc.kv_visible / 2**20, kv_read_over_visible=acc.kv_ratio,
                         gb_per_s=rate / 1e9, over_copy_bandwidth=rate / bandwidth if bandwidth else None))
    return rows


def flex_check(device: str, tiny: bool, bandwidth: float | None = None) -> dict:
    return dict(groups=groups(device, tiny), decode=decode(device, tiny, bandwidth))
