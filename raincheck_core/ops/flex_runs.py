"""The pages a step's FlexAttention segments read, as runs of one page within one segment's list
(ops/flex_layout.py builds the step's block lists from them): found by a few passes over a general list's
keys, or read off each page's first slot where the list is the first slots of a page table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class Runs:
    """The pages a step's segments read: one entry per run of one page in one segment's list."""

    seg: Tensor             # the segment
    page: Tensor            # the page
    count: Tensor           # slots of the page in the list
    first: Tensor           # where the run starts in the step's concatenated lists (increasing)
    end: Tensor             # where it ends (increasing)
    whole_before: Tensor    # [runs + 1] the runs of `page_size` slots before each run (and in all)
    whole_pages: Tensor     # the pages of those runs, in order
    other_pages: Tensor     # the pages of the other runs, in order



# A step with both kinds of lists takes each to its place in list order, which costs more than reading a
# page-table prefix's few keys saves unless those lists hold most of the step's keys: a padded decode step
# (padding rows read one scratch slot) does, a step with fused chunks (about half the keys) does not
MIXED_PAGED_SHARE = 4


class ListedRuns:
    """The runs of one page in each segment's list, in list order (positions in the step's concatenated
    lists), and each segment's last slot. A list that is the first slots of a page table (decode, verify,
    prefill rows) has one run per page, read off its first slot on each page (a 4K-token decode row: 256
    slot ids read, not 4,096); the others' come from a few passes over their keys (`flat`: those lists
    concatenated; `offset[s]`: where segment s's keys start in the step's lists less where in `flat`).
    `MIXED_PAGED_SHARE` says when a step with both kinds reads every key instead."""

    def __init__(self, read_slots: list[Tensor], prefixes: list[bool], k_len: Tensor, k_start: Tensor,
                 page_size: int):
        n_seg = len(read_slots)
        shift = page_size.bit_length() - 1      # a shift where the page size is a power of two: `//` is slow
        self.pow2, self.shift, self.page_size = page_size == 1 << shift, shift, page_size
        # numpy for the per-segment and per-run bookkeeping: small arrays, where a torch op costs more than its work
        lens, starts = k_len.numpy(), k_start.numpy()
        general = [s for s in range(n_seg) if not prefixes[s]]
        paged = [s for s in range(n_seg) if prefixes[s]]
        if general and paged and lens[paged].sum() < MIXED_PAGED_SHARE * lens[general].sum():
            general, paged = list(range(n_seg)), []     # a step with fused chunks: every key read
        self.offset = np.zeros(n_seg, dtype=np.int64)
        self.flat = None
        if not paged:
            self._keys(read_slots, k_start.numpy(), lens)
            return
        p_first, p_count, p_page, p_last, pages = self._pages(read_slots, paged, lens, starts)
        if not general:
            self.first, self.count, self.page, self.last = (torch.from_numpy(x) for x in (p_first, p_count, p_page,
                                                                                         p_last))
            return
        # both kinds: each run to its place in list order (segments in order, runs in order within each)
        g = np.array(general)
        g_len = lens[g]
        g_start = g_len.cumsum() - g_len
        self._keys([read_slots[s] for s in general], g_start, g_len)
        self.offset[g] = starts[g] - g_start
        at = self.first.numpy()
        g_runs = np.diff(np.searchsorted(at, g_start), append=at.shape[0])
        runs_of_seg = np.zeros(n_seg, dtype=np.int64)
        runs_of_seg[g], runs_of_seg[paged] = g_runs, pages
        seg_run = runs_of_seg.cumsum() - runs_of_seg
        last = np.empty(n_seg, dtype=np.int64)
        last[g], last[paged] = self.last.numpy(), p_last
        first, count, run_page = (np.empty(int(runs_of_seg.sum()), dtype=np.int64) for _ in range(3))
        g_owner = np.repeat(np.arange(g.size), g_runs)
        g_at = seg_run[g][g_owner] + np.arange(at.shape[0]) - np.repeat(g_runs.cumsum() - g_runs, g_runs)
        first[g_at], count[g_at], run_page[g_at] = at + self.offset[g][g_owner], self.count.numpy(), self.page.numpy()
        p_at = np.repeat(seg_run[paged], pages) + np.arange(p_first.shape[0]) - np.repeat(pages.cumsum() - pages, pages)
        first[p_at], count[p_at], run_page[p_at] = p_first, p_count, p_page
        self.first, self.count, self.page, self.last = (torch.from_numpy(x) for x in (first, count, run_page, last))

    def _keys(self, lists: list[Tensor], k_start: np.ndarray, k_len: np.ndarray) -> None:
        """The runs of `lists` from every key, positions in their own concatenation."""
        flat = self.flat = torch.cat(lists).cpu().long()
        start = torch.from_numpy(k_start)
        self.last = flat[start + torch.from_numpy(k_len) - 1]
        page = flat >> self.shift if self.pow2 else flat // self.page_size
        begins = torch.ones(flat.shape, dtype=torch.bool)
        torch.ne(page[1:], page[:-1], out=begins[1:])
        begins[start] = True
        self.first = torch.from_numpy(begins.numpy().nonzero()[0])     # numpy's: torch's CPU nonzero is 3-4x slower
        self.count = torch.diff(self.first, append=torch.tensor([flat.shape[0]]))
        self.page = page.index_select(0, self.first)

    def _pages(self, read_slots: list[Tensor], paged: list[int], lens: np.ndarray, starts: np.ndarray
               ) -> tuple[np.ndarray, ...]:
        """(first, count, page of each run, each list's last slot, runs per list) of the page-table prefixes
        `paged`: one run per page, from each list's first slot on each page."""
        ps = self.page_size
        pages = -(-lens[paged] // ps)
        heads = np.concatenate([read_slots[s].cpu().numpy()[::ps] for s in paged]).astype(np.int64)
        if ((heads & (ps - 1)) if self.pow2 else heads % ps).any():     # the marking's cheap check, per page
            raise ValueError("a read list marked as a page-table prefix does not start each page at its first slot")
        ends = pages.cumsum() - 1
        index = np.arange(heads.shape[0]) - np.repeat(ends + 1 - pages, pages)
        count = np.minimum(np.repeat(lens[paged], pages) - index * ps, ps)
        first = np.repeat(starts[paged], pages) + index * ps
        page = heads >> self.shift if self.pow2 else heads // ps
        return first, count, page, heads[ends] + count[ends] - 1, pages


def runs_of(listed: ListedRuns, k_start: Tensor, page_size: int) -> tuple[Runs, Tensor, Tensor]:
    """(the step's runs, each segment's first run (none: the next one's), each segment's run count)."""
    n_seg, first, count, page = k_start.shape[0], listed.first, listed.count, listed.page
    run_start = torch.searchsorted(first, k_start)
    per_seg = torch.diff(run_start, append=torch.tensor([first.shape[0]]))
    seg = torch.repeat_interleave(torch.arange(n_seg), per_seg, output_size=first.shape[0])
    # per run: masked_select, 2-4x faster on the CPU than indexing with [] (same result)
    whole, zero = count == page_size, torch.zeros(1, dtype=torch.long)
    runs = Runs(seg=seg, page=page, count=count, first=first, end=first + count,
                whole_before=torch.cat([zero, whole.cumsum(0)]), whole_pages=page.masked_select(whole),
                other_pages=page.masked_select(~whole))
    return runs, run_start, per_seg
