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



class ListedRuns:
    """The runs of one page in each segment's list, in list order (positions in the step's concatenated
    lists), and each segment's last slot. Where every list of the step is the first slots of a page table
    (decode, verify and prefill steps), from each list's first slot on each page, one run per page (a
    4K-token decode row: 256 slots read, not 4,096); otherwise from a few passes over every key (`flat`, the
    lists concatenated), since merging the two kinds in list order cost a step with fused chunks more than
    reading its decode rows' few keys saved."""

    def __init__(self, read_slots: list[Tensor], prefixes: list[bool], k_len: Tensor, k_start: Tensor,
                 page_size: int):
        shift = page_size.bit_length() - 1      # a shift where the page size is a power of two: `//` is slow
        pow2 = page_size == 1 << shift
        self.flat = None
        if all(prefixes):       # in numpy: a few small arrays, where each torch op costs more than its work
            lens, starts = k_len.numpy(), k_start.numpy()
            pages = -(-lens // page_size)
            heads = np.concatenate([s.numpy()[::page_size] for s in read_slots]).astype(np.int64)
            ends = pages.cumsum() - 1
            index = np.arange(heads.shape[0]) - np.repeat(ends + 1 - pages, pages)
            count = np.minimum(np.repeat(lens, pages) - index * page_size, page_size)
            self.last = torch.from_numpy(heads[ends] + count[ends] - 1)
            self.first = torch.from_numpy(np.repeat(starts, pages) + index * page_size)
            self.count = torch.from_numpy(count)
            self.page = torch.from_numpy(heads >> shift if pow2 else heads // page_size)
            return
        flat = self.flat = torch.cat(read_slots).cpu().long()
        self.last = flat[k_start + k_len - 1]
        page = flat >> shift if pow2 else flat // page_size
        begins = torch.ones(flat.shape, dtype=torch.bool)
        torch.ne(page[1:], page[:-1], out=begins[1:])
        begins[k_start] = True
        self.first = torch.from_numpy(begins.numpy().nonzero()[0])     # numpy's: torch's CPU nonzero is 3-4x slower
        self.count = torch.diff(self.first, append=torch.tensor([flat.shape[0]]))
        self.page = page.index_select(0, self.first)


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
