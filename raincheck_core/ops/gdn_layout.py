"""Where the rows of a step's packed GDN sequences go, built once per step and read by every GDN op
(flash-linear-attention keeps its `cu_seqlens` helpers apart from its ops the same way, in `ops/utils`).

This module sits below every GDN op and imports none of them: `VarlenLayout` (`varlen_layout`) holds the
step's `PackedSequences` (ops/gdn_sequences.py: what the native kernel, ops/gdn_kernel.py, reads) with what
only the torch path (ops/gdn_varlen.py, ops/gdn_varlen_torch.py) and fla's (ops/fla_adapter.py) read, each
laid out on first use: the short convolution's rows (`ConvLayout`), the chunked rule's blocks
(`BlockLayout`) and the runs without splits (`SplitRuns`, with `cumulative`: fla's `cu_seqlens`).

A sequence may carry a *split*: the state and conv history after its first `split` rows are returned
too (the deferred-prefill join, docs/mechanism.md §5; see ops/gdn_varlen.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .gdn_sequences import PackedSequences, packed_sequences
from .uploads import Uploads, put_together


@dataclass
class BlockLayout:
    """How the chunked rule cuts the sequences: each sequence (each part of a split sequence) into
    blocks of `chunk` rows."""

    chunk: int
    num_blocks: int
    row_slot: Tensor                # [R] flat position (block * chunk + offset) of each row
    steps: list[tuple[slice, Tensor, bool]]    # per scan step: its blocks (a range), their sequences, all-in-order
    captures: list[tuple[Tensor, Tensor]]      # per scan step: (positions in its blocks, split index)


@dataclass
class ConvLayout:
    """The torch path's short convolution: each sequence's K-1 history rows laid out right before its rows
    in an extended buffer."""

    ext_rows: int
    hist_at: Tensor                 # [N * (K-1)] extended-buffer rows of the incoming histories
    row_at: Tensor                  # [R] extended-buffer row of each packed row
    tail_at: Tensor                 # [N, K-1] rows of each sequence's history after all its rows
    split_tail_at: Tensor | None    # [J, K-1] … after the first `split` rows of each split sequence


@dataclass
class SplitRuns:
    """The sequences as runs for varlen kernels that know no splits (fla's): a first pass of each
    sequence's rows up to its split (all of them where it has none), then a second pass of what split
    sequences have after their split, from the states the first pass ends with."""

    first_rows: Tensor              # [R1] packed rows of the first pass, sequence after sequence
    first_cu: Tensor                # [N + 1] its cumulative lengths (fla's `cu_seqlens`)
    split_seqs: Tensor | None       # [J] the sequences with a split, in split order (None: none)
    rest_seqs: Tensor               # [M] those with rows after their split
    rest_rows: Tensor               # [R2]
    rest_cu: Tensor                 # [M + 1]


@dataclass
class Targets:
    """Where the new states of some outputs (sequences, or splits) go, split by destination: `pool_at`
    of them into pool rows `pool_rows`, `buffer_at` into rows `buffer_rows` of the step's buffers."""

    pool_at: Tensor
    pool_rows: Tensor
    buffer_at: Tensor
    buffer_rows: Tensor


def targets(out_row: Tensor | None, n: int, put: Callable[[Tensor], Tensor]) -> Targets:
    """`PackedSequences.out_row` (or `split_out_row`) of `n` outputs as `Targets`, each tensor moved by `put`."""
    if out_row is None:
        every = put(torch.arange(n))
        return Targets(every[:0], every[:0], every, every)
    pool, buffer = (out_row >= 0).nonzero().flatten(), (out_row < 0).nonzero().flatten()
    return Targets(*put_together(put, (pool, out_row[pool], buffer, -1 - out_row[buffer])))


@dataclass
class VarlenLayout:
    """Where the rows of N packed sequences go; built once per step, shared by every GDN layer. What
    only the torch path reads (the conv layout, the chunked rule's blocks, the gathers) is laid out on
    first use: the native kernel reads `seqs` alone."""

    num_seqs: int
    kernel: int
    # sequences: where each packed row is read from (a step row, or an appended row: a deferred chunk's
    # recorded conv lead), first rows, lengths, splits; what the native kernel reads
    seqs: PackedSequences
    chunk_size: int = 64
    device: torch.device | str = "cpu"
    uploads: Uploads | None = None      # the step's staged copies (ops/uploads.py), else a copy per tensor

    def lay_out(self, parts: tuple[str, ...]) -> None:
        """Build `parts` (names of this layout's lazily built parts) now: with the step's staged tensors,
        before they are sent."""
        for name in parts:
            getattr(self, name)

    def put(self, t: Tensor) -> Tensor:
        """`t` (built on the host) on the layout's device: staged with the step's other tensors where it has
        `uploads` and they are not sent yet."""
        return t.to(self.device) if self.uploads is None else self.uploads.put(t)

    @cached_property
    def conv(self) -> ConvLayout:
        lead, n = self.kernel - 1, self.num_seqs
        lens, seq_start = self.seqs.seq_len, self.seqs.seq_start
        ext_start = seq_start + torch.arange(n) * lead                  # where each history begins
        hist_at = (ext_start[:, None] + torch.arange(lead)[None, :]).flatten()
        row_seq = torch.repeat_interleave(torch.arange(n), lens)
        total = int(lens.sum())
        rank, live_len, before_split = torch.arange(total), lens, self.seqs.split_row
        if self.seqs.live is not None:
            # each sequence's live rows first, in order, then its idle ones: a live row's convolution reads
            # the live rows before it, and the histories end at live rows
            live = self.seqs.live
            order = torch.argsort(row_seq * 2 + (~live).long(), stable=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(total)
            live_len = torch.bincount(row_seq[live], minlength=n)
            cum = cumulative(live.long())
            before_split = cum[(seq_start + self.seqs.split_row).clamp(min=0)] - cum[seq_start]
        row_at = rank + (row_seq + 1) * lead
        tail_at = (ext_start + live_len)[:, None] + torch.arange(lead)[None, :]
        split_tail_at = None
        split_ids = (self.seqs.split_row >= 0).nonzero().flatten()
        if len(split_ids):
            ends = ext_start[split_ids] + before_split[split_ids]
            split_tail_at = ends[:, None] + torch.arange(lead)[None, :]
        parts = (hist_at, row_at, tail_at) if split_tail_at is None else (hist_at, row_at, tail_at, split_tail_at)
        moved = put_together(self.put, parts)
        return ConvLayout(total + n * lead, *moved[:3], moved[3] if split_tail_at is not None else None)

    @cached_property
    def blocks(self) -> BlockLayout:
        splits = [None if r < 0 else r for r in self.seqs.split_row.tolist()]
        return _block_layout(self.seqs.seq_len.tolist(), splits, self.chunk_size, self.put)

    @cached_property
    def runs(self) -> SplitRuns:
        """The sequences as runs without splits, on the layout's device (built once per step)."""
        lens, splits = self.seqs.seq_len, self.seqs.split_row
        starts = self.seqs.seq_start
        first = torch.where(splits >= 0, splits, lens)
        split_seqs = (splits >= 0).nonzero().flatten()
        rest = (lens - first)[split_seqs]
        more = split_seqs[rest > 0]
        rest = rest[rest > 0]
        first_rows, first_cu, splits_at, more, rest_rows, rest_cu = put_together(self.put, (
            _run_rows(starts, first), cumulative(first), split_seqs, more, _run_rows(starts[more] + first[more], rest),
            cumulative(rest)))
        return SplitRuns(first_rows, first_cu, splits_at if len(split_seqs) else None, more, rest_rows, rest_cu)

    @cached_property
    def idle(self) -> Tensor | None:
        """`[R, 1]` the packed rows that do not run (`PackedSequences.live`), on the layout's device, or None."""
        return None if self.seqs.live is None else self.put((~self.seqs.live)[:, None])

    @cached_property
    def slots(self) -> Tensor:
        """`seqs.slot` on the layout's device: the pool slot each sequence starts from."""
        return self.put(self.seqs.slot)

    @cached_property
    def targets(self) -> tuple[Targets, Targets]:
        """Where the sequences' and the splits' new states go (`targets`), on the layout's device."""
        return (targets(self.seqs.out_row, self.seqs.count, self.put),
                targets(self.seqs.split_out_row, self.seqs.splits, self.put))

    @cached_property
    def join_seqs(self) -> Tensor:
        """`seqs.join_seq` on the layout's device: the sequence whose final state drives each join."""
        return self.put(self.seqs.join_seq)

    @cached_property
    def join_slots(self) -> Tensor:
        """`seqs.join_live` on the layout's device: the pool slot of the live state each join corrects."""
        return self.put(self.seqs.join_live)

    @cached_property
    def seed_rows(self) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None]:
        """For the torch path: (sequences, seed rows) of the sequences that start from a seed history /
        seed state instead of their slot's, or None."""
        def pairs(at: Tensor | None) -> tuple[Tensor, Tensor] | None:
            if at is None or not bool((at >= 0).any()):
                return None
            seqs = (at >= 0).nonzero().flatten()
            return self.put(seqs), self.put(at[seqs])
        return pairs(self.seqs.seed_hist_at), pairs(self.seqs.seed_state_at)

    def step_rows(self, total: int) -> Tensor | None:
        """For one-row sequences, in a step (or buffer) of `total` rows: the step row of each, or None when
        they are exactly those rows in order (a decode-only step: no gather, no scatter). Rows 0, 1, ... of
        a step that holds more rows after them (decode rows before prefill chunks) are not all of it."""
        return None if self.seqs.in_order and total == self.seqs.source.shape[0] else self.source_rows

    @cached_property
    def source_rows(self) -> Tensor:
        return self.put(self.seqs.source)

    @cached_property
    def gathers(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For the torch path, once per step: (packed rows read from the step, those step rows, packed
        rows appended, their appended-row indices), found on the host (a `nonzero` on a GPU waits for it)."""
        source = self.seqs.source
        at = (source >= 0).nonzero().flatten()
        appended = (source < 0).nonzero().flatten()
        return tuple(put_together(self.put, (at, source[at], appended, -1 - source[appended])))


def _run_rows(starts: Tensor, lengths: Tensor) -> Tensor:
    """The packed rows of runs starting at `starts` of `lengths` rows, run after run."""
    return torch.repeat_interleave(starts - cumulative(lengths)[:-1], lengths) + torch.arange(int(lengths.sum()))


def cumulative(lengths: Tensor) -> Tensor:
    """`[0, l0, l0 + l1, ...]` (int64): sequence lengths as fla's `cu_seqlens`."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).long()


def varlen_layout(lengths: list[int], kernel: int, splits: list[int | None] | None = None,
                  chunk_size: int = 64, device: torch.device | str = "cpu", source: Tensor | list[int] | None = None,
                  slots: list[int] | None = None, joins: list[tuple[int, int]] | None = None,
                  seeds: tuple[list[int] | None, list[int] | None] | None = None,
                  out_rows: tuple[list[int], list[int]] | None = None, live: list[bool] | None = None,
                  uploads: Uploads | None = None) -> VarlenLayout:
    """Layout of sequences of `lengths` rows; `splits[s]` (or None) marks a split after that many rows;
    `source` says where each packed row is read from (see `PackedSequences.source`; default: step row r);
    `slots` the state-pool row each sequence starts from (default: row s); `joins` (sequence, live
    state's row) of each join (see ops/gdn_varlen.py `gated_deltanet_varlen`); `seeds` the seed rows
    sequences start from (see `gated_deltanet_rows` there); `out_rows` where the new states go
    (`PackedSequences.out_row`); `live` which packed rows run (`PackedSequences.live`); `uploads` the step's
    staged copies its tensors go by (else each is copied to `device` as it is made)."""
    splits = splits or [None] * len(lengths)
    for s, split in enumerate(splits):
        if split == 0:      # the state after zero rows would be the initial one
            raise ValueError(f"split after 0 rows is not supported (sequence {s})")
    return VarlenLayout(num_seqs=len(lengths), kernel=kernel,
                        seqs=packed_sequences(lengths, splits, source, slots, joins, seeds, out_rows=out_rows,
                                              live=live),
                        chunk_size=chunk_size, device=device, uploads=uploads)


def _block_layout(lengths: list[int], splits: list[int | None], chunk_size: int, put: Callable[[Tensor], Tensor]
                  ) -> BlockLayout:
    """Every part of every sequence starts a block. Blocks are numbered step-major (every sequence's first
    block, then every second block, ...), so that each scan step's blocks are one contiguous range, read
    and written as views rather than gathered. Its tensors are built on the host and moved by `put`."""
    n = len(lengths)
    seq_start = [0, *itertools.accumulate(lengths)][:-1]
    split_ids = [s for s in range(n) if splits[s] is not None]
    parts: list[tuple[int, int, int, int | None]] = []              # (seq, first row, rows, split index)
    for s, length in enumerate(lengths):
        if splits[s] is None:
            parts.append((s, 0, length, None))
        else:
            j = split_ids.index(s)
            parts.append((s, 0, splits[s], j))
            if length > splits[s]:
                parts.append((s, splits[s], length - splits[s], None))
    longest = max((p[2] for p in parts), default=1)
    chunk = max(1, min(chunk_size, longest))
    blocks: list[tuple[int, int]] = []                              # (scan step, sequence) of each block
    part_blocks: list[tuple[int, int, list[int]]] = []              # (first packed row, rows, its blocks)
    capture_at: list[tuple[int, int]] = []                          # (block, split index)
    step_of_seq = [0] * n
    for s, first, rows, split_index in parts:
        ids = []
        for _ in range(-(-rows // chunk)):
            ids.append(len(blocks))
            blocks.append((step_of_seq[s], s))
            step_of_seq[s] += 1
        part_blocks.append((seq_start[s] + first, rows, ids))
        if split_index is not None:     # the state after this part: after its last block
            capture_at.append((ids[-1], split_index))
    order = sorted(range(len(blocks)), key=lambda i: blocks[i])
    number = torch.empty(len(blocks), dtype=torch.long)
    number[torch.tensor(order, dtype=torch.long)] = torch.arange(len(blocks))
    row_slot = torch.empty(sum(lengths), dtype=torch.long)
    for row, rows, ids in part_blocks:
        offs = torch.arange(rows)
        row_slot[row:row + rows] = number[torch.tensor(ids, dtype=torch.long)][offs // chunk] * chunk + offs % chunk
    steps, captures = [], []
    split_of = dict(capture_at)
    at = 0
    for _, group in itertools.groupby(order, key=lambda i: blocks[i][0]):    # one pass: `order` is by step
        ids = list(group)
        seqs = [blocks[i][1] for i in ids]
        steps.append((slice(at, at + len(ids)), put(torch.tensor(seqs, dtype=torch.long)), seqs == list(range(n))))
        pos = [(k, split_of[i]) for k, i in enumerate(ids) if i in split_of]
        captures.append((put(torch.tensor([p for p, _ in pos], dtype=torch.long)),
                         put(torch.tensor([j for _, j in pos], dtype=torch.long))))
        at += len(ids)
    return BlockLayout(chunk=chunk, num_blocks=len(blocks), row_slot=put(row_slot), steps=steps,
                       captures=captures)
