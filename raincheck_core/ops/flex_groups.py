"""One FlexAttention call of a step (ops/flex_layout.py decides which segments go in which): a `FlexGroup`,
its tensors and the BlockMask it makes of them, built from the step's page runs (`build_group`) or, for decode
rows, from their page tables' pages (`one_row_group`); and the per-slot tables of the pool its mask reads
(`SlotTables`). In numpy on the host, the tensors made at the end and staged for the device."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .flex_blocks import block_buffer, buffer_length, prefix_lists, write_runs
from .flex_runs import Runs, table_pages
from .uploads import Uploads

# Query rows per tile: a group of shorter segments is one tile of its query bucket, longer ones tiles of
# Q_TILE rows. Triton's GPU kernels need query blocks of at least 16 rows (the matrix instructions'
# smallest M): the main kernel then runs 16-row blocks, and a one-tile group below 16 rows takes
# FlexAttention's decoding kernel, which packs a KV head's query heads into one block (`declared_q_block`).
# A tile computes its padded rows too: a segment of n rows pads at most 15 rows past 16 and its bucket's
# rows below (a decode row: none; a 31-row deferred chunk: 1; prefill chunks of 128+ rows: < 12%).
Q_TILE = 16
# block-list columns per query tile, at least: the kernel is specialised on the lists' strides, so a pool
# whose sessions stay under this many pages (4K tokens of 16-slot pages) compiles one kernel per shape
MIN_COLS = 256
# A writer entry is (step * STAMP + segment) * STAMP + row in int64: segments of a step and rows of a
# segment below STAMP, steps below MAX_STEP (then the tables start again from clean)
STAMP = 1 << 16
MAX_STEP = 1 << 31


def bucket(n: int) -> int:
    """A padded size: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class SlotTables:
    """Per-slot tables of one KV pool that each step's layout writes for the slots it touches: `writer` the
    stamp (`step * STAMP + segment`) times `STAMP` plus the row index of the row writing the slot this
    step, `hidden` the step's number on slots a deferred chunk of this step may not read. Entries of older
    steps carry older stamps, so nothing is cleared. Kept per pool (`tables_of`), outside the step's
    layout: graph capture copies a layout's tensors each step, and these are the pool's."""

    def __init__(self, slots: int, page_size: int, device: torch.device | str):
        self.slots = slots
        self.page_size = page_size
        self.writer = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.hidden = torch.full((slots,), -1, dtype=torch.long, device=device)
        # `hide_skipped`'s (ops/flex_runs.py), on the host where it works: a tally per slot (zero between
        # steps), a mark per page
        self.tally = np.zeros(slots, dtype=np.int64)
        self.page_mark = np.full(slots // page_size, -1, dtype=np.int64)
        self.step = 0
        # block-list columns per tile: the most pages a segment has read, as a power of two, at least
        # MIN_COLS. It only grows, because the compiled kernel is specialised on the block lists' strides
        self.cols = MIN_COLS


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tables_of(pool: object, slots: int, page_size: int, device: torch.device | str) -> SlotTables:
    """The slot tables of `pool` (any object owning a KV cache; built on first use, dropped with it)."""
    t = _TABLES.get(pool)
    if t is None or t.slots != slots or t.page_size != page_size:
        t = _TABLES[pool] = SlotTables(slots, page_size, device)
    return t


@dataclass
class FlexGroup:
    """Segments of one query bucket, as one FlexAttention call over the pool. The block lists are kept as
    flat buffers (ops/flex_blocks.py `block_buffer`) and the BlockMask is made from them at each call
    (`block_mask`), so that a captured graph's static group, whose tensors later steps are copied into, is
    what the call reads. Every tensor's shape follows from the group's segments bucket and query bucket alone."""

    q_rows: Tensor          # [N * q] packed row of each padded query position (0 for padding)
    out_rows: Tensor        # [N * q] where each position's output goes: its packed row, or R (dropped) for padding
    stamp: Tensor           # [N] each segment's stamp (`SlotTables.writer`), -1 for padding segments
    last: Tensor            # [N] each segment's last own slot (its readable list's last)
    filtered: Tensor        # [N] the segment's list skips slots on its pages (a deferred chunk after GEN)
    rows: Tensor            # [N] real query rows
    step: Tensor            # [1] the step's number (`SlotTables.hidden`)
    partial_num: Tensor     # [N, 1, tiles] pages each tile reads under the mask ...
    partial_idx: Tensor     # [N * tiles * cols + tail] ... which (`block_buffer`)
    full_num: Tensor        # [N, 1, tiles] pages each tile reads whole, no mask ...
    full_idx: Tensor        # ... which
    q: int                  # query bucket
    tile: int               # query rows per tile
    cols: int               # block-list columns per tile (a bucket of the longest list)

    def declared_q_block(self, shared_heads: int, folded: int = 1) -> int:
        """The query block size the BlockMask declares: the tile, or for a one-tile group shorter than Q_TILE
        the rows FlexAttention's decoding kernel packs into one block (the bucket's rows times the query
        heads sharing a KV head, at least Q_TILE; the kernel needs its block to divide the declared one).
        `folded`: the query heads of a KV head passed as its rows (`block_mask`), a tile's rows each."""
        return self.tile * folded if self.tile == Q_TILE else max(Q_TILE, bucket(self.q * shared_heads))

    def block_mask(self, tables: SlotTables, shared_heads: int = 1, folded: int = 1) -> BlockMask:
        """The group's BlockMask. `folded` > 1: the call passes the `folded` query heads of each KV head as
        rows of one head (query position i * folded + j: row i, the KV head's j-th query head), so a tile's
        blocks serve all of them (ops/flex_attention.py); the mask reads the row off the position."""
        n, tiles, pages = self.stamp.shape[0], self.q // self.tile, tables.slots // tables.page_size
        page_size, writer, hidden = tables.page_size, tables.writer, tables.hidden
        stamp, last, filtered, rows, step = self.stamp, self.last, self.filtered, self.rows, self.step

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            row = q_idx // folded if folded > 1 else q_idx
            w = writer[kv_idx]
            own = (w // STAMP) == stamp[b]
            lb = last[b]
            later = (kv_idx > lb) & (kv_idx < (lb // page_size + 1) * page_size)
            skipped = filtered[b] & (hidden[kv_idx] == step[0])
            return torch.where(own, (w % STAMP) <= row, ~later & ~skipped) & (row < rows[b])

        def wide(buf: Tensor) -> Tensor:
            return buf.as_strided((n, 1, tiles, pages), (tiles * self.cols, tiles * self.cols, self.cols, 1))

        return BlockMask.from_kv_blocks(self.partial_num, wide(self.partial_idx), self.full_num, wide(self.full_idx),
                                        BLOCK_SIZE=(self.declared_q_block(shared_heads, folded), page_size),
                                        mask_mod=mask_mod,
                                        seq_lengths=(self.q * folded, tables.slots), compute_q_blocks=False)


@dataclass
class Segments:
    """Per segment of the step that a group is built for from the runs, in plan order (int64, or bool)."""

    q_len: np.ndarray
    k_len: np.ndarray
    k_start: np.ndarray     # where its list starts in the concatenated lists
    run_start: np.ndarray   # its first run
    stamp: np.ndarray
    last: np.ndarray        # the last slot of each list (the segment's last own row)
    filtered: np.ndarray    # the list skips slots on its pages
    row_start: np.ndarray   # its first row among the step's rows
    rows: int               # the step's rows


def build_group(sel: np.ndarray, q: int, n: int, segs: Segments, runs: Runs, step: int, tables: SlotTables,
                up: Uploads) -> FlexGroup:
    """The group of segments `sel` (query bucket `q`), padded to `n` segments. In numpy on the host, as the
    step's runs and segments are, its tensors made at the end: ~50 small-array ops, each a few µs as torch
    calls and well under one as numpy's."""
    tile = min(Q_TILE, q)
    tiles = q // tile
    m = sel.shape[0]
    q_len, k_start, k_len = segs.q_len, segs.k_start, segs.k_len
    # tile t holds rows [t * tile, (t + 1) * tile) of a segment (clipped to its rows); row i sees ranks
    # < k - n + i + 1. A page is listed when the tile's last row sees its first listed slot, and read
    # whole (no mask) when the page is whole in the list and the tile's first row sees its last slot.
    # A segment's runs are in rank order, so per tile the listed runs are a prefix of its runs, and those
    # read whole the runs of `page_size` slots in a shorter prefix: each is a search in the step's runs.
    n_rows, run_start = q_len[sel][:, None], segs.run_start[sel][:, None]
    base = (k_start + k_len - q_len)[sel][:, None]                 # row i sees `flat` before base + i + 1
    lo = np.arange(tiles)[None] * tile
    hi = np.minimum(lo + tile, n_rows)
    used = lo < n_rows                                              # tiles past a segment's rows list none
    listed_end = np.where(used, np.searchsorted(runs.first, base + hi), run_start)    # [segments, tiles]
    full_end = np.where(used, np.searchsorted(runs.end, base + lo + 1, side="right"), run_start)
    whole_before = runs.whole_before
    listed = np.zeros((n, tiles), dtype=np.int64)
    listed[:m] = listed_end - run_start
    full = np.zeros((n, tiles), dtype=np.int64)
    full[:m] = whole_before[full_end] - whole_before[run_start]
    tables.cols = cols = max(tables.cols, bucket(max(1, int(listed.max()))))
    pages = tables.slots // tables.page_size
    # full blocks: each tile's are the first of its segment's whole runs; partial blocks: the other runs
    # before the tile's full prefix ends, then every listed run after it
    whole = whole_before[run_start]                         # the whole runs before each segment's first
    full_buf = prefix_lists(full, runs.whole_pages, whole[:, 0], cols, buffer_length(n, tiles, cols, pages))
    partial_buf = block_buffer(n, tiles, cols, pages)
    skipped_whole = (full_end - run_start) - full[:m]                       # others before the full prefix
    tile_rows = np.arange(m * tiles)
    write_runs(partial_buf, tile_rows, 0, np.broadcast_to(run_start - whole, skipped_whole.shape).ravel(),
                skipped_whole.ravel(), runs.other_pages, cols)
    write_runs(partial_buf, tile_rows, skipped_whole.ravel(), full_end.ravel(), (listed_end - full_end).ravel(),
                runs.page, cols)
    # per query position: its packed row (0 for padding) and where its output goes (past the rows: dropped)
    qi = np.arange(q)
    real = np.zeros((n, q), dtype=bool)
    real[:m] = qi[None, :] < n_rows
    rows = np.zeros((n, q), dtype=np.int64)
    rows[:m] = segs.row_start[sel][:, None] + qi[None, :]
    rows = rows.ravel() * real.ravel()
    # per segment, padded to `n`: stamp, last slot, rows, whether its list skips slots
    per = np.zeros((3, n), dtype=np.int64)
    per[0, m:] = -1
    per[:, :m] = segs.stamp[sel], segs.last[sel], q_len[sel]
    filtered = np.zeros(n, dtype=bool)
    filtered[:m] = segs.filtered[sel]
    per_t, num_t = up.put(per), up.put(np.stack([listed - full, full]).astype(np.int32))
    return FlexGroup(
        q_rows=up.put(rows), out_rows=up.put(np.where(real.ravel(), rows, segs.rows)),
        stamp=per_t[0], last=per_t[1], filtered=up.put(filtered), rows=per_t[2],
        step=up.put(np.array([step])), partial_num=num_t[0].view(n, 1, tiles),
        partial_idx=up.put(partial_buf), full_num=num_t[1].view(n, 1, tiles),
        full_idx=up.put(full_buf), q=q, tile=tile, cols=cols)


def one_row_group(read_slots: list[Tensor], table_pages_of: list[np.ndarray | None] | None, seg_keys: np.ndarray,
                  sid: np.ndarray, row_start: np.ndarray, rows: int, size: int, step: int, tables: SlotTables,
                  up: Uploads) -> FlexGroup:
    """`build_group` for the one-row group (segments `sid`) whose lists are all page tables' first slots (ops/
    flex_layout.py decides): each row sees its whole list, so its page table's pages are its blocks, whole but
    for a partly filled last one (under the mask: the slots after the row's own). The pages are the tables'
    own (`table_pages_of`, a decode row's), else read off each page's first slot of the list; then a few numpy
    ops on small arrays, where the general build takes ~70 torch ops (~0.6 ms of host time a decode step at
    any batch)."""
    ps, m = tables.page_size, sid.shape[0]
    n = max(size, bucket(m))    # `size`: a fixed shape's (else 0)
    k = seg_keys[sid]
    pages, full = -(-k // ps), k // ps
    page = _row_pages(read_slots, table_pages_of, sid.tolist(), pages.tolist(), ps)
    first = pages.cumsum() - pages                              # each list's first page among all
    cols = tables.cols = max(tables.cols, bucket(int(pages.max(initial=1))))
    # the partial blocks' lists, the full ones'
    blocks = np.zeros((2, buffer_length(n, 1, cols, tables.slots // ps)), dtype=np.int32)
    # the full blocks: each list's pages but a partly filled last one, from its tile's first column
    within = np.arange(int(full.sum())) - np.repeat(full.cumsum() - full, full)
    blocks[1, np.repeat(np.arange(m) * cols, full) + within] = page[np.repeat(first, full) + within]
    partial = full < pages
    blocks[0, np.flatnonzero(partial) * cols] = page[(first + pages - 1)[partial]]
    # per segment, padded to `n`: packed row, output row (padding: past the step's rows), stamp, last slot,
    # rows; and the partial and full blocks each tile lists
    per = np.zeros((5, n), dtype=np.int64)
    per[1, m:], per[2, m:] = rows, -1
    per[:4, :m] = row_start[sid], row_start[sid], step * STAMP + sid, page[first + pages - 1] * ps + (k - 1) % ps
    per[4, :m] = 1
    num = np.zeros((2, n), dtype=np.int32)
    num[:, :m] = partial, full
    per_t, num_t, blocks_t = up.put(per), up.put(num), up.put(blocks)
    return FlexGroup(
        q_rows=per_t[0], out_rows=per_t[1], stamp=per_t[2], last=per_t[3],
        filtered=up.put(np.zeros(n, dtype=bool)), rows=per_t[4],
        step=up.put(np.array([step])), partial_num=num_t[0].view(n, 1, 1), partial_idx=blocks_t[0],
        full_num=num_t[1].view(n, 1, 1), full_idx=blocks_t[1], q=1, tile=1, cols=cols)


def _row_pages(read_slots: list[Tensor], table_pages_of: list[np.ndarray | None] | None, sid: list[int],
               counts: list[int], page_size: int) -> np.ndarray:
    """The pages the lists of segments `sid` read, `counts[i]` of segment `sid[i]`'s, concatenated: the first
    ones of its table's pages where it carries them (a slice each: ~0.3 µs, against ~1.5 to read a list's
    page heads off its tensor), else read off its list's first slot on each page (`table_pages`)."""
    if table_pages_of is None or any(table_pages_of[s] is None for s in sid):
        return table_pages([read_slots[s] for s in sid], page_size)
    return np.concatenate([table_pages_of[s][:c] for s, c in zip(sid, counts, strict=True)])
