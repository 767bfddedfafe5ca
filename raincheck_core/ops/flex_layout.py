"""Where a packed step's attention reads on FlexAttention (ops/flex_attention.py runs the call): the
step's `FlexLayout`, built once per step on the host and read by every attention layer.

The segments of a step are the batch dimension of the call, grouped by query length: one-row segments
(decode rows) run as one batch of 1-row queries, longer segments (prefill chunks, deferred chunks) as
batches of queries padded to a power of two, in tiles of `Q_TILE` rows. The keys are the layer's pool
itself, `[1, kv_heads, slots, d]` (a view: nothing is copied out of it), and FlexAttention's KV block is
the pool's page, so a segment's block list is the list of pages its readable slots sit on, in order:
the kernel reads those pages where they are (the paged-attention layout of
`torch.nn.attention.experimental._paged_attention`, with the pages of the segment's own read list instead
of a per-sequence page table, and nothing of `[rows, keys]` size). A page every row of a tile may read
whole is a *full* block (no mask evaluated); the others (a session's last, partly filled page, the pages
holding a segment's own rows, pages a deferred chunk must skip some of) are *partial* blocks, where
`mask_mod` decides per slot from per-slot tables of the pool (`SlotTables`) and a few numbers per
segment:
- a slot this step writes for the same segment (its own rows) is seen causally by row index;
- a slot after the segment's last own slot on that slot's page was claimed later (or not at all);
- a slot a deferred chunk must not see (docs/mechanism.md §4: its turn's generated tokens) is marked in
  the `hidden` table for this step; every other slot on the segment's pages it may read.
That is the bottom-right causal rule of ops/attention.py over each segment's readable list.

The layout is built from the plan's slot lists with vectorised ops (the page runs read off each page's first
slot where a list is a page table's first slots, less the positions a deferred chunk leaves out,
ops/flex_runs.py, else a few passes over the keys; then work per page run, per query tile and per block
listed; one table write per row written and per slot a chunk leaves out, slot by slot only the pages two
chunks read). A step's one-row group, when its lists are page tables' first slots (decode rows, padded or
not), is each list's pages, all read whole but a partly filled last one: it is built from the pages a decode
row carries (its table's own, `Segment.read_pages`; else each page's first slot) in a few numpy ops
(ops/flex_groups.py `one_row_group`: a decode step's layout ~0.06-0.09 ms of host time at B = 1, 0.27 at 64 x
4K, against 0.34 and 0.58 by the general build), and the general build covers the step's other segments only
(a fused step's chunks). Kept apart from the kernel call and its compile management because it is host-side
work a step does once; it imports torch, numpy, its groups (ops/flex_groups.py), runs and block lists
(`python -m bench.attention --against REV` loads them by themselves, as they were at a git revision, to time
two builds).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from .flex_groups import (
    MAX_STEP,
    STAMP,
    FlexGroup,
    Segments,
    SlotTables,
    bucket,
    build_group,
    one_row_group,
    tables_of,
)
from .flex_runs import ListedRuns, Prefix, hide_skipped, runs_of, table_prefix
from .uploads import Uploads


class SegmentLengths:
    """Per segment of a step, its rows and readable keys: what the accounting (ops/attention_accounting.py)
    reads, never the forward. Not a dataclass, so that graph capture (engine/graphs.py) does not take these
    plain values, which change every decode step, as part of a step's shape."""

    def __init__(self, q: list[int], k: list[int]):
        self.q = q
        self.k = k


@dataclass(frozen=True)
class FixedGroups:
    """A step's groups fixed by its caller rather than by its segments' rows: a padded decode step's
    (engine/padding.py), so that every step of a bucket has the same group shapes and one graph skeleton
    (engine/graphs.py). `query[s]` is the query bucket of segment s's group, 0 where the segment is not
    attended (padding rows: no row reads their outputs, which are zero); `size[q]` the segments of group
    q (at least those it holds)."""

    query: list[int]
    size: dict[int, int]


@dataclass
class FlexLayout:
    """Built once per step, read by every attention layer of the step."""

    write_slots: Tensor     # [R] the slot each packed row's K/V goes to
    groups: list[FlexGroup]
    tables: SlotTables      # the pool's (not a dataclass: graph capture leaves it alone)
    lengths: SegmentLengths

    @property
    def q_lens(self) -> list[int]:
        return self.lengths.q

    @property
    def k_lens(self) -> list[int]:
        return self.lengths.k


def flex_layout(q_lens: list[int], read_slots: list[Tensor], write_slots: Tensor,
                device: torch.device | str = "cpu", pool: object | None = None,
                fixed: FixedGroups | None = None, prefixes: list[Prefix] | None = None,
                pages: list[np.ndarray | None] | None = None, uploads: Uploads | None = None) -> FlexLayout:
    """The layout of segments with `q_lens[s]` rows each (packed in order) reading `read_slots[s]` (own
    slots last, bottom-right causal) from `pool` (a KVPool: its `k [layers, slots, kv, d]` and
    `page_size`) on `device`; segments grouped by their rows' query bucket, or as `fixed` says.
    `prefixes[s]` (ops/flex_runs.py `Prefix`): True where segment s's list is the first slots of a page
    table (its pages read off every `page_size`-th slot), an array of positions where it is those less the
    positions (a deferred chunk's), False (the default) for any list, read key by key. `pages[s]`, where not
    None: the pages of segment s's table (int64), of which its list (a table's first slots) spans the first
    ones; the one-row group reads them there rather than off the lists. `uploads`: the step's
    staged copies (ops/uploads.py), which the layout's tensors and its table writes go by; else each is
    copied to `device` as it is made."""
    if pool is None:
        raise ValueError("the flex layout reads the pool in place: it needs the pool")
    slots, page_size = pool.k.shape[1], pool.page_size
    tables = tables_of(pool, slots, page_size, device)
    if tables.step + 1 >= MAX_STEP:         # entries of old steps could match new stamps: start clean
        for table in (tables.writer, tables.hidden, tables.page_mark):
            table[:] = -1
        tables.step = 0
    tables.step += 1
    step = tables.step
    n_seg = len(q_lens)
    k_lens = [s.shape[0] for s in read_slots]
    if len(k_lens) != n_seg or not all(k_lens) or any(map(operator.lt, k_lens, q_lens)):
        raise ValueError("each segment reads at least its own rows' slots, and at least one slot")
    if n_seg >= STAMP or max(q_lens) >= STAMP:
        raise ValueError(f"a flex step holds fewer than {STAMP} segments of fewer than {STAMP} rows each")
    # per segment as arrays, so that what follows picks segments with array ops rather than Python loops
    seg_rows, seg_keys = np.array(q_lens, dtype=np.int64), np.array(k_lens, dtype=np.int64)
    query = _buckets(q_lens, prefixes) if fixed is None else fixed.query
    sizes = {q: 0 for q in sorted(set(query) - {0})} if fixed is None else fixed.size
    for q, size in sizes.items() if fixed is not None else ():
        ids = [s for s, at in enumerate(query) if at == q]
        if len(ids) > size or any(q_lens[s] > q for s in ids):
            raise ValueError(f"group {q} holds {len(ids)} segments, rows up to {q}: more than its fixed shape")
    # which segment and row writes each slot written this step (the causal reads of a segment's own rows)
    row_start = seg_rows.cumsum() - seg_rows
    of_row = np.repeat(np.arange(n_seg), seg_rows)
    code = (step * STAMP + of_row) * STAMP + np.arange(of_row.shape[0]) - row_start[of_row]
    up = Uploads(device) if uploads is None else uploads
    written = up.put(write_slots)
    up.then(partial(tables.writer.index_copy_, 0, written, up.put(code)))
    # the decode rows' group from their pages alone, the others from the runs of their segments' lists (and of
    # padding rows', attended by none)
    paged_rows = _one_row_pages(query, sizes, prefixes, fixed is None)
    in_group = np.array(query, dtype=np.int64)
    if any(q != 1 or not paged_rows for q in sizes):
        at = np.flatnonzero(in_group != 1) if paged_rows else np.arange(n_seg)
        rest = at.tolist()
        q_len, k_len = seg_rows[at], seg_keys[at]
        k_start = k_len.cumsum() - k_len
        # the pages each segment reads, in order: runs of one page within one segment's list
        listed = ListedRuns([read_slots[s] for s in rest], [False] * len(rest) if prefixes is None else
                            [prefixes[s] for s in rest], k_len, k_start, page_size)
        runs, run_start, per_seg = runs_of(listed, k_start, page_size)
        filtered = hide_skipped(tables, step, listed, k_len, run_start, per_seg, runs, up)
        segs = Segments(q_len, k_len, k_start, run_start, step * STAMP + at, listed.last, filtered, row_start[at],
                        int(of_row.shape[0]))
    groups = []
    for q, size in sizes.items():       # in order: each group may widen the block lists of the next
        if q == 1 and paged_rows:
            groups.append(one_row_group(read_slots, pages, seg_keys, np.flatnonzero(in_group == 1), row_start,
                                         of_row.shape[0], size, step, tables, up))
        else:
            ids = np.flatnonzero(in_group[at] == q)
            groups.append(build_group(ids, q, max(size, bucket(ids.shape[0])), segs, runs, step, tables, up))
    return FlexLayout(written, groups, tables, SegmentLengths(list(q_lens), k_lens))


def _buckets(q_lens: list[int], prefixes: list[Prefix] | None) -> list[int]:
    """Each segment's query bucket. A one-row segment whose list leaves slots out (a deferred chunk's last
    row, cut by the step's deferred budget) takes the two-row group, so that the one-row group stays the
    decode rows', read off their pages (`_one_row_group`) rather than every list's runs."""
    if prefixes is None:
        return [bucket(n) for n in q_lens]
    # a decode row's mark is Python's True: that case costs no call (a step has one per session)
    return [(1 if p is True or table_prefix(p) else 2) if n == 1 else bucket(n)
            for n, p in zip(q_lens, prefixes, strict=True)]


def _one_row_pages(query: list[int], sizes: dict[int, int], prefixes: list[Prefix] | None, bucketed: bool) -> bool:
    """Whether a step's one-row group reads page tables' first slots alone: decode rows, beside whatever
    other groups the step has (deferred chunks, prefill; padding rows are in no group). `bucketed`: the
    query buckets are `_buckets`', which put only such lists in the one-row group."""
    return prefixes is not None and 1 in sizes and (bucketed or all(
        p is True or table_prefix(p) for q, p in zip(query, prefixes, strict=True) if q == 1))
