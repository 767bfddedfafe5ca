"""The pages a step's FlexAttention segments read, as runs of one page within one segment's list
(ops/flex_layout.py builds the step's block lists from them): found by a few passes over a general list's
keys, or read off each page's first listed slot where the list is a page table's first slots, whole or
less some positions (a deferred chunk's view: its turn's generated slots left out). All in numpy (int64) on
the host: small arrays, where a torch op costs more than its work; the layout makes its tensors at the end."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from .uploads import Uploads

# how a read list relates to its session's page table (`ListedRuns`): any list of slots (False), the table's
# first slots (True), or those less the positions a sorted int64 array holds
Prefix = bool | np.ndarray


@dataclass
class Runs:
    """The pages a step's segments read: one entry per run of one page in one segment's list."""

    seg: np.ndarray             # the segment
    page: np.ndarray            # the page
    count: np.ndarray           # slots of the page in the list
    first: np.ndarray           # where the run starts in the step's concatenated lists (increasing)
    end: np.ndarray             # where it ends (increasing)
    whole_before: np.ndarray    # [runs + 1] the runs of `page_size` slots before each run (and in all)
    whole_pages: np.ndarray     # the pages of those runs, in order
    other_pages: np.ndarray     # the pages of the other runs, in order


# A step with both kinds of lists takes each to its place in list order, which costs more than reading the
# page-table lists' few keys saves unless those lists hold most of the step's keys: a padded step's padding
# rows (general lists of one scratch slot each) hold almost none
MIXED_PAGED_SHARE = 4


class ListedRuns:
    """The runs of one page in each segment's list, in list order (positions in the step's concatenated
    lists), and each segment's last slot. A list that is a page table's first slots (`prefixes[s]` True:
    decode, verify, prefill rows) has one run per page, read off its first slot on each page (a 4K-token
    decode row: 256 slot ids read, not 4,096); one that is those less some positions (`prefixes[s]` an
    array of them: a deferred chunk's) has one run per page it keeps a slot of, counted from the positions
    left out, and `hidden` holds the slots it leaves out on those pages. The other lists' runs come from a
    few passes over their keys (`flat`: those lists concatenated; `offset[s]`: where segment s's keys start
    in the step's lists less where in `flat`). `MIXED_PAGED_SHARE` says when a step with both kinds reads
    every key instead."""

    def __init__(self, read_slots: list[Tensor], prefixes: list[Prefix], lens: np.ndarray, starts: np.ndarray,
                 page_size: int):
        n_seg = len(read_slots)
        shift = page_size.bit_length() - 1      # a shift where the page size is a power of two: `//` is slow
        self.pow2, self.shift, self.page_size = page_size == 1 << shift, shift, page_size
        # each list's left-out positions: an array of them, none (one shared empty array: most lists), or
        # None for any list
        skips = [p if isinstance(p, np.ndarray) else _NONE_LEFT_OUT if p else None for p in prefixes]
        general = [s for s in range(n_seg) if skips[s] is None]
        paged = [s for s in range(n_seg) if skips[s] is not None]
        if general and paged and lens[paged].sum() < MIXED_PAGED_SHARE * lens[general].sum():
            general, paged = list(range(n_seg)), []     # every key read
        self.paged = np.zeros(n_seg, dtype=bool)
        self.paged[paged] = True
        self.hidden = np.zeros(0, dtype=np.int64)
        self.offset = np.zeros(n_seg, dtype=np.int64)
        self.flat: np.ndarray | None = None
        if not paged:
            self._keys(read_slots, starts, lens)
            return
        p_first, p_count, p_page, p_last, pages = self._pages(read_slots, paged, [skips[s] for s in paged], lens,
                                                              starts)
        if not general:
            self.first, self.count, self.page, self.last = p_first, p_count, p_page, p_last
            return
        # both kinds: each run to its place in list order (segments in order, runs in order within each)
        g = np.array(general)
        g_len = lens[g]
        g_start = g_len.cumsum() - g_len
        self._keys([read_slots[s] for s in general], g_start, g_len)
        self.offset[g] = starts[g] - g_start
        at = self.first
        g_runs = np.diff(np.searchsorted(at, g_start), append=at.shape[0])
        runs_of_seg = np.zeros(n_seg, dtype=np.int64)
        runs_of_seg[g], runs_of_seg[paged] = g_runs, pages
        seg_run = runs_of_seg.cumsum() - runs_of_seg
        last = np.empty(n_seg, dtype=np.int64)
        last[g], last[paged] = self.last, p_last
        first, count, run_page = (np.empty(int(runs_of_seg.sum()), dtype=np.int64) for _ in range(3))
        g_owner = np.repeat(np.arange(g.size), g_runs)
        g_at = seg_run[g][g_owner] + np.arange(at.shape[0]) - np.repeat(g_runs.cumsum() - g_runs, g_runs)
        first[g_at], count[g_at], run_page[g_at] = at + self.offset[g][g_owner], self.count, self.page
        p_at = np.repeat(seg_run[paged], pages) + np.arange(p_first.shape[0]) - np.repeat(pages.cumsum() - pages, pages)
        first[p_at], count[p_at], run_page[p_at] = p_first, p_count, p_page
        self.first, self.count, self.page, self.last = first, count, run_page, last

    def _keys(self, lists: list[Tensor], k_start: np.ndarray, k_len: np.ndarray) -> None:
        """The runs of `lists` from every key, positions in their own concatenation."""
        flat = self.flat = torch.cat(lists).cpu().long().numpy()     # one torch call, whatever the lists' device
        self.last = flat[k_start + k_len - 1]
        page = flat >> self.shift if self.pow2 else flat // self.page_size
        begins = np.ones(flat.shape, dtype=bool)
        np.not_equal(page[1:], page[:-1], out=begins[1:])
        begins[k_start] = True
        self.first = np.flatnonzero(begins)
        self.count = np.diff(self.first, append=flat.shape[0])
        self.page = page[self.first]

    def _pages(self, read_slots: list[Tensor], paged: list[int], skips: list[np.ndarray], lens: np.ndarray,
               starts: np.ndarray) -> tuple[np.ndarray, ...]:
        """(first, count, page of each run, each list's last slot, runs per list) of the page-table lists
        `paged`, which leave out the positions `skips` of their tables' first slots: one run per page they
        keep a slot of, its first slot read off the list (`_left_out` where some leave any out)."""
        ps = self.page_size
        left = np.array([k.shape[0] for k in skips], dtype=np.int64)
        ends = lens[paged] + left                   # the table slots each list spans
        pages = -(-ends // ps)
        base = pages.cumsum() - pages               # each list's first page among all of theirs
        index = np.arange(int(pages.sum())) - np.repeat(base, pages)
        count = np.minimum(np.repeat(ends, pages) - index * ps, ps)
        lists = [read_slots[s] for s in paged]
        if left.any():
            first, count, page, tail = self._left_out(lists, skips, left, ends, base, pages, index, count)
            return first + np.repeat(starts[paged], tail), count, page, self._last(page, tail, ends), tail
        page = table_pages(lists, ps)
        return np.repeat(starts[paged], pages) + index * ps, count, page, self._last(page, pages, ends), pages

    def _last(self, page: np.ndarray, runs: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Each list's last slot, from its last run's page: the list's last row, never left out."""
        return page[runs.cumsum() - 1] * self.page_size + (ends - 1) % self.page_size

    def _left_out(self, lists: list[Tensor], skips: list[np.ndarray], left: np.ndarray, ends: np.ndarray,
                  base: np.ndarray, pages: np.ndarray, index: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, ...]:
        """`_pages` where some lists leave positions out: (each run's first in its own list, count, page, runs
        per list), counted from the left-out positions; sets `hidden` to the slots they leave out on the
        pages they read. On the lists' positions all at once: per list, one host view and one read."""
        ps, shift = self.page_size, self.shift
        left_out = np.concatenate(skips, dtype=np.int64, casting="unsafe")
        leaving = left > 0
        if (left_out[left.cumsum()[leaving] - 1] >= ends[leaving] - 1).any():     # each list's last left out
            raise ValueError("a read list leaves out its own last slot")
        # the left-out positions as positions among all lists' pages, increasing (each list's are)
        skipped = left_out + np.repeat(base * ps, left)
        on = skipped >> shift if self.pow2 else skipped // ps
        count = count - np.bincount(on, minlength=count.shape[0])
        # where each page's first kept slot sits on it: after the run of left-out positions holding its first
        offset = np.zeros(count.shape[0], dtype=np.int64)
        at = np.flatnonzero(skipped == on * ps)
        run_last = np.flatnonzero(np.diff(skipped, append=skipped[-1] + 2) != 1)
        offset[on[at]] = skipped[run_last[np.searchsorted(run_last, at)]] + 1 - on[at] * ps
        kept = count > 0
        listed = count.cumsum() - count
        local = listed - np.repeat(listed[base], pages)         # each page's first kept slot in its list
        # the slots read: each kept page's first kept one; every page's first of a list leaving none out, as
        # `table_pages` reads it, whatever positions out of another list's range say of its pages
        whole = np.repeat(~leaving, pages)
        read = kept | whole
        where = np.where(whole, index * ps, local)[read]
        cut = read.cumsum()[base + pages - 1].tolist()          # where each list's positions end in `where`
        heads = np.concatenate([x[where[a:b]] for x, a, b in zip(_on_host(lists), [0, *cut[:-1]], cut, strict=True)]
                               ).astype(np.int64)
        if not np.array_equal((heads & (ps - 1)) if self.pow2 else heads % ps, offset[kept]) \
                or not kept[base + pages - 1].all():        # the marking's cheap check, per page
            raise ValueError("a read list marked as a page-table prefix less some positions does not start "
                             "each page it reads at the first slot it keeps there")
        page_of = np.zeros(count.shape[0], dtype=np.int64)
        page_of[kept] = heads >> shift if self.pow2 else heads // ps
        keep = kept[on]
        self.hidden = page_of[on[keep]] * ps + (skipped[keep] & (ps - 1) if self.pow2 else skipped[keep] % ps)
        return local[kept], count[kept], page_of[kept], np.add.reduceat(kept.astype(np.int64), base)


_NONE_LEFT_OUT = np.zeros(0, dtype=np.int64)
_NONE_LEFT_OUT.flags.writeable = False


def table_prefix(prefix: Prefix) -> bool:
    """Whether a list marked `prefix` is its page table's first slots, none left out."""
    return not prefix.size if isinstance(prefix, np.ndarray) else bool(prefix)


def table_pages(lists: list[Tensor], page_size: int) -> np.ndarray:
    """The pages of lists that are page tables' first slots (`Prefix` True), in order: read off every
    `page_size`-th slot, one host view and one slice per list. Refuses a list whose slot read there is not
    its page's first (the marking's cheap check, per page)."""
    heads = np.concatenate([x[::page_size] for x in _on_host(lists)]).astype(np.int64) if lists \
        else np.zeros(0, dtype=np.int64)
    shift = page_size.bit_length() - 1          # a shift and a mask where the page size is a power of two
    pow2 = page_size == 1 << shift
    if ((heads & (page_size - 1)) if pow2 else heads % page_size).any():
        raise ValueError("a read list marked as a page-table prefix does not start each page at its first slot")
    return heads >> shift if pow2 else heads // page_size


def _on_host(lists: list[Tensor]) -> list[np.ndarray]:
    """Each list as a numpy array (a view on the CPU, where `cpu()` would be one call more per list)."""
    return [t.numpy() if t.is_cpu else t.cpu().numpy() for t in lists]


def runs_of(listed: ListedRuns, k_start: np.ndarray, page_size: int) -> tuple[Runs, np.ndarray, np.ndarray]:
    """(the step's runs, each segment's first run (none: the next one's), each segment's run count)."""
    first, count, page = listed.first, listed.count, listed.page
    run_start = np.searchsorted(first, k_start)
    per_seg = np.diff(run_start, append=first.shape[0])
    whole = count == page_size
    whole_before = np.zeros(count.shape[0] + 1, dtype=np.int64)
    np.cumsum(whole, out=whole_before[1:])
    runs = Runs(seg=np.repeat(np.arange(k_start.shape[0]), per_seg), page=page, count=count, first=first,
                end=first + count, whole_before=whole_before, whole_pages=page[whole], other_pages=page[~whole])
    return runs, run_start, per_seg


# `hide_skipped` tallies the lists listing a slot in multiples of this, the runs whose pages hold it in units
LISTED = 1 << 20


class HiddenTables(Protocol):
    """What `hide_skipped` writes and uses of a pool's slot tables (ops/flex_groups.py `SlotTables`)."""

    page_size: int
    hidden: Tensor          # per slot: the step whose deferred chunks may not read it
    tally: np.ndarray       # per slot, zero between steps: the host's scratch
    page_mark: np.ndarray   # per page: the latest step that looked at it slot by slot


def hide_skipped(tables: HiddenTables, step: int, listed: ListedRuns, k_len: np.ndarray, run_start: np.ndarray,
                 pages: np.ndarray, runs: Runs, uploads: Uploads) -> np.ndarray:
    """Mark in `tables.hidden` the slots on a segment's pages, up to its last, that its list skips (a
    deferred chunk's view without its turn's generated tokens, docs/mechanism.md §4). Returns which
    segments skip any. A list from its session's first slot covers every slot of its pages up to its last
    unless it skips some: the segments whose counts say so are *filtered*. The slots a page-table list
    leaves out are known (`listed.hidden`); on a page a general list skips slots of, or one that two
    filtered lists read, the pages are looked at slot by slot, all in one pass. The table holds one view
    per slot and step, so filtered segments that read such a page (two chunks of one session, or of
    sessions sharing prefix pages) must agree on it: a slot one skips and another lists is refused. The
    table is written by way of `uploads` (ops/uploads.py), after the step's copy."""
    page_size, last = tables.page_size, listed.last
    in_page = last % page_size + 1              # per segment, not per run
    filtered = k_len != (pages - 1) * page_size + in_page
    if not filtered.any():
        return filtered
    listing = pages > 0
    ends = (run_start + pages - 1)[listing]             # a segment's last run: the page of its last slot
    final = np.zeros(runs.seg.shape, dtype=bool)
    final[ends] = True
    mine = filtered[runs.seg]
    whole = np.full_like(runs.count, page_size)         # a run's slots, skipping none
    whole[ends] = in_page[listing]
    tables.page_mark[runs.page[mine & (runs.count < whole)]] = step
    at = np.flatnonzero(mine & (tables.page_mark[runs.page] == step))      # filtered runs there
    seg = runs.seg[at]
    general = ~listed.paged[seg]
    # the pages looked at slot by slot: a general list's, and those two filtered lists read
    page, which, readers = np.unique(runs.page[at], return_inverse=True, return_counts=True)
    slot_by_slot = readers > 1
    slot_by_slot[which[general]] = True
    known = listed.hidden
    looked = np.isin(known // page_size, page[slot_by_slot])     # known slots on those pages
    _mark(tables, known[~looked], step, uploads)
    at, seg, general = (x[slot_by_slot[which]] for x in (at, seg, general))
    if not at.shape[0]:
        return filtered
    count = runs.count[at]
    every = runs.page[at][:, None] * page_size + np.arange(page_size)[None]     # [runs, page]
    kept = ~final[at][:, None] | (every <= last[seg][:, None])
    spans = every[kept]
    # per slot, how many of these runs' pages hold it (units) and how many list it (multiples of LISTED):
    # a general list's slots are read off `listed.flat`, a page-table list's are its pages' less the known ones
    g_at, g_seg, g_count = at[general], seg[general], count[general]
    slots = listed.flat[np.repeat(runs.first[g_at] - listed.offset[g_seg] - (g_count.cumsum() - g_count), g_count)
                        + np.arange(int(g_count.sum()))] if g_at.shape[0] else g_at
    tally = tables.tally
    np.add.at(tally, spans, 1)
    np.add.at(tally, slots, LISTED)
    np.add.at(tally, every[~general][kept[~general]], LISTED)
    np.add.at(tally, known[looked], -LISTED)
    held = tally[spans]
    tally[spans], tally[slots] = 0, 0
    skipped = held % LISTED > held // LISTED
    if (skipped & (held >= LISTED)).any():
        raise ValueError("two deferred chunks of one step disagree on which slots of a page they read")
    _mark(tables, spans[skipped], step, uploads)
    return filtered


def _mark(tables: HiddenTables, slots: np.ndarray, step: int, uploads: Uploads) -> None:
    """`tables.hidden[slots] = step`, on the table's device, once `slots` are there."""
    uploads.then(partial(tables.hidden.index_fill_, 0, uploads.put(slots), step))
