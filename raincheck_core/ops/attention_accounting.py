"""Work and traffic of a step's attention, from its layout, by construction (issue 39 item 5).

What a step's FlexAttention calls (ops/flex_attention.py) compute and read follows from the layout's
block lists alone: a query tile computes `tile rows x page_size` score entries for every page it lists
(partial or full) and reads that page's K and V once; a segment's pages are read from the pool where
they are. Set against what the visibility rule allows (row i of a segment of n rows over k readable keys
sees k - n + i + 1 of them; docs/mechanism.md §4) this gives the padding factors the issue bounds:
score entries computed / visible and K/V bytes read / visible. `allocated_bytes` measures what a call
allocates (torch's profiler, per op), the cross-check of "no copy of the K/V it reads".

All counts are per attention layer and per query head for scores, per attention layer for bytes (every
layer of a step has the same layout). The GDN fields are for the recurrent layers' state traffic, filled
by their own accounting (issue 39 item 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

from .flex_groups import STAMP
from .flex_layout import FlexLayout


@dataclass
class StepAccounting:
    """One step's attention work and traffic, per layer."""

    score_computed: int         # score entries the kernel computes (padded rows, whole pages), per query head
    score_visible: int          # score entries the visibility rule allows, per query head
    kv_read: int                # K+V bytes read from the pool: each page a segment lists, once per segment
    kv_visible: int             # K+V bytes of the slots the rows may read (each segment's readable list)
    kv_tile_reads: int          # K+V bytes summed over query tiles (a page is read again by each tile listing it)
    metadata: int               # bytes of the step's layout tensors (block lists, row maps, per-segment numbers)
    # GDN state bytes moved by the step / bytes of state that must be read and written (None: not counted
    # here; the recurrent layers' accounting fills them)
    gdn_state_moved: int | None = None
    gdn_state_needed: int | None = None

    @property
    def score_ratio(self) -> float:
        return self.score_computed / max(1, self.score_visible)

    @property
    def kv_ratio(self) -> float:
        return self.kv_read / max(1, self.kv_visible)


def visible_scores(q_lens: list[int], k_lens: list[int]) -> int:
    """Score entries the rule allows: row i of an n-row segment over k keys sees k - n + i + 1."""
    return sum(n * (k - n) + n * (n + 1) // 2 for n, k in zip(q_lens, k_lens, strict=True))


def flex_accounting(layout: FlexLayout, kv_heads: int, head_dim: int, itemsize: int) -> StepAccounting:
    """The accounting of a step laid out by `flex_layout`, for a pool of `kv_heads x head_dim` entries of
    `itemsize` bytes."""
    page_size = layout.tables.page_size
    slot_bytes = 2 * kv_heads * head_dim * itemsize
    computed = read = tile_reads = 0
    for g in layout.groups:
        blocks = (g.partial_num + g.full_num).long()[:, 0]              # [N, tiles]
        computed += int(blocks.sum()) * g.tile * page_size
        tile_reads += int(blocks.sum()) * page_size * slot_bytes
        # later tiles of a segment see more keys: the last tile's pages are every page the segment reads
        read += int(blocks.max(dim=1).values.sum()) * page_size * slot_bytes
    metadata = layout.write_slots.nbytes + sum(
        t.nbytes for g in layout.groups for t in (g.q_rows, g.out_rows, g.stamp, g.last, g.filtered, g.rows,
                                                  g.step, g.partial_num, g.partial_idx, g.full_num, g.full_idx))
    return StepAccounting(
        score_computed=computed, score_visible=visible_scores(layout.q_lens, layout.k_lens), kv_read=read,
        kv_visible=sum(layout.k_lens) * slot_bytes, kv_tile_reads=tile_reads, metadata=metadata)


def pages_read(layout: FlexLayout) -> list[set[int]]:
    """The pool pages each segment's query tiles read, in plan order (what "a row computes no score outside
    its session" is checked against)."""
    out: dict[int, set[int]] = {}
    pages = layout.tables.slots // layout.tables.page_size
    for g in layout.groups:
        n, tiles = g.stamp.shape[0], g.q // g.tile
        for num, buf in ((g.partial_num, g.partial_idx), (g.full_num, g.full_idx)):
            idx = buf.as_strided((n, tiles, min(g.cols, pages)), (tiles * g.cols, g.cols, 1))
            for b in range(n):
                if int(g.stamp[b]) < 0:
                    continue
                seg = int(g.stamp[b]) % STAMP
                for t in range(tiles):
                    out.setdefault(seg, set()).update(idx[b, t, :int(num[b, 0, t])].tolist())
    return [out.get(s, set()) for s in range(len(layout.q_lens))]


def allocated_bytes(fn: Callable[[], object]) -> int:
    """Bytes the CPU allocator hands out while `fn` runs and each op still holds when it returns (torch's
    profiler with memory profiling, each op's self memory: outputs and copies; a scratch buffer an op frees
    before returning is not counted, one it returns is)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())
