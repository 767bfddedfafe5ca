"""The sequences of a step's packed GDN call as the native kernel reads them (ops/gdn_kernel.py), built once
per step from Python lists: `PackedSequences` (`packed_sequences`, and both groups of a step as one call:
`fused_sequences`). Kept apart from the layouts derived from it for the torch and fla paths
(ops/gdn_layout.py), since this description is all the native kernel needs.

A sequence may carry a *split*: the state and conv history after its first `split` rows are returned
too (the deferred-prefill join, docs/mechanism.md §5; see ops/gdn_varlen.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .int_lists import long_tensor


@dataclass
class PackedSequences:
    """The sequences of a packed GDN call as the kernel reads them, built once per step (int64,
    contiguous), with the bounds the kernel's reads need, so that no layer reduces over them again."""

    source: torch.Tensor        # [R] packed row r reads step row source[r], or appended row -1 - source[r]
    seq_start: torch.Tensor     # [N] first packed row of each sequence
    seq_len: torch.Tensor       # [N]
    split_row: torch.Tensor     # [N] rows before the sequence's split, -1: none
    split_index: torch.Tensor   # [N] its index among the splits, -1: none
    slot: torch.Tensor          # [N] the state-pool row each sequence starts from
    join_seq: torch.Tensor      # [J] the sequence whose final state drives each join
    join_live: torch.Tensor     # [J] the pool slot of the live state each join corrects
    seed_hist_at: torch.Tensor | None    # [N] row of the seed histories a sequence starts from, -1: its slot's
    seed_state_at: torch.Tensor | None   # [N] row of the seed states a sequence starts from, -1: its slot's
    # where each sequence's final state and history go: pool row out_row[s] >= 0 (the other row of its slot,
    # cache/gdn_state.py), or row -1 - out_row[s] of the step's buffers; None: buffer row s, for every s
    out_row: torch.Tensor | None
    split_out_row: torch.Tensor | None   # [S] the same for the states at the splits, by split index
    step_rows_needed: int       # 1 + the largest step row read
    appended: int               # appended rows read
    splits: int
    longest: int                # rows of the longest sequence
    slots_needed: int           # 1 + the largest pool row read or written
    seed_hists_needed: int = 0  # 1 + the largest seed row read
    seed_states_needed: int = 0
    count: int = 0              # sequences
    joins: int = 0
    joins_after: int = 0        # the joins run once this many sequences are done (those after may seed from them)
    buffered: int = 0           # rows of the step's buffers for final states and histories
    split_buffered: int = 0     # … for the states and histories at the splits
    in_order: bool = False      # packed row r is step row r, for every r
    # [R] rows that run (None: all): the others only fill a padded step's fixed shapes (engine/padding.py)
    # and change no state: their gates are zeroed (no decay, no update) and the short convolution reads
    # past them, so a sequence's histories end at its live rows
    live: torch.Tensor | None = None


def packed_sequences(lengths: list[int], splits: list[int | None], source: torch.Tensor | list[int] | None,
                     slots: list[int] | None = None, joins: list[tuple[int, int]] | None = None,
                     seeds: tuple[list[int] | None, list[int] | None] | None = None,
                     joins_after: int | None = None,
                     out_rows: tuple[list[int], list[int]] | None = None,
                     live: list[bool] | None = None) -> PackedSequences:
    """`source` None: packed row r is step row r. `slots`: the pool row each sequence starts from (None:
    row s for sequence s, as for states gathered in sequence order). `joins`: (sequence, live state's pool
    row) of each join. `seeds`: per sequence, the row of the seed histories and of the seed states it
    starts from instead of its slot's (-1: its slot's). `joins_after`: the joins run once this many
    sequences are done (default: all), and join only sequences before it. `out_rows`: where each
    sequence's and each split's new state goes (see `PackedSequences.out_row`; None: the step's buffers,
    in order). `live`: per packed row, whether it runs (`PackedSequences.live`). Built from Python lists
    (a step's few sequences): a handful of small tensors, no reductions over them."""
    total = sum(lengths)
    if source is None:
        rows = list(range(total))
    else:
        rows = source.tolist() if isinstance(source, torch.Tensor) else list(source)
    if len(rows) != total or (live is not None and len(live) != total):
        raise ValueError(f"source (and live) have {len(rows)} rows for {total} packed rows")
    slots = list(range(len(lengths))) if slots is None else list(slots)
    joins = list(joins or [])
    if len(slots) != len(lengths) or any(not 0 <= seq < len(lengths) for seq, _ in joins):
        raise ValueError("one slot per sequence, and joins of sequences that are there")
    if min(slots, default=0) < 0 or min((live for _, live in joins), default=0) < 0:
        raise ValueError("pool slots are not negative")
    joins_after = len(lengths) if joins_after is None else joins_after
    if not 0 <= joins_after <= len(lengths) or any(seq >= joins_after for seq, _ in joins):
        raise ValueError("the joins run after the sequences they join")
    split_index, count = [], 0
    for p in splits:
        split_index.append(-1 if p is None else count)
        count += p is not None
    starts = [0] * len(lengths)
    for i in range(1, len(lengths)):
        starts[i] = starts[i - 1] + lengths[i - 1]

    seed_hists, seed_states = seeds if seeds is not None else (None, None)
    for at in (seed_hists, seed_states):
        if at is not None and len(at) != len(lengths):
            raise ValueError("one seed row (or -1) per sequence")
    outs, split_outs = out_rows if out_rows is not None else ([], [])
    if out_rows is not None and (len(outs) != len(lengths) or len(split_outs) != count
                                 or _not_dense([-1 - r for r in outs if r < 0])
                                 or _not_dense([-1 - r for r in split_outs if r < 0])):
        raise ValueError("one output row per sequence and split, buffer rows 0, 1, ... in order")
    # every array in one tensor (one allocation and copy per step, not ten), handed out as views
    parts = [rows, starts, lengths, [-1 if p is None else p for p in splits], split_index, slots,
             [seq for seq, _ in joins], [live for _, live in joins], seed_hists or [], seed_states or [],
             outs, split_outs]
    flat = long_tensor([v for part in parts for v in part])
    (source_t, start_t, len_t, split_t, index_t, slot_t, join_t, live_t, hist_t,
     state_t, out_t, split_out_t) = flat.split([len(part) for part in parts])
    return PackedSequences(
        source=source_t, seq_start=start_t, seq_len=len_t, split_row=split_t, split_index=index_t, slot=slot_t,
        join_seq=join_t, join_live=live_t, seed_hist_at=None if seed_hists is None else hist_t,
        seed_state_at=None if seed_states is None else state_t,
        out_row=None if out_rows is None else out_t, split_out_row=None if out_rows is None else split_out_t,
        step_rows_needed=max(rows, default=-1) + 1, appended=sum(r < 0 for r in rows), splits=count,
        longest=max(lengths, default=0),
        slots_needed=max([*slots, *(live for _, live in joins), *outs, *split_outs], default=-1) + 1,
        seed_hists_needed=max(seed_hists or [], default=-1) + 1,
        seed_states_needed=max(seed_states or [], default=-1) + 1, count=len(lengths), joins=len(joins),
        joins_after=joins_after, in_order=rows == list(range(total)),
        buffered=len(lengths) if out_rows is None else sum(r < 0 for r in outs),
        split_buffered=count if out_rows is None else sum(r < 0 for r in split_outs),
        live=None if live is None else torch.tensor(live, dtype=torch.bool))


def _not_dense(rows: list[int]) -> bool:
    """Buffer rows are 0, 1, ... in order of first use, each once."""
    return rows != list(range(len(rows)))


def fused_sequences(first: PackedSequences | None, then: PackedSequences | None) -> PackedSequences:
    """The sequences of `first` (with its joins and appended rows), then those of `then`, as one call: the
    joins run between them, and `then`'s seed rows index the call's own outputs (its histories, where
    `first`'s sequences come first, and its corrected states, the joins' own)."""
    if then is not None and (then.joins or then.appended):
        raise ValueError("fused_sequences: the sequences after the joins have none of their own, nor appended rows")
    if any(part is not None and part.live is not None for part in (first, then)):
        raise ValueError("fused_sequences: the native kernel runs every row (no idle rows)")
    # one group alone is already that call (a decode-only step: 64 sessions' lists rebuilt cost ~0.1 ms)
    if first is None and then is not None:
        return dataclasses.replace(then, joins_after=0)
    if then is None and first is not None and first.out_row is not None and first.seed_hist_at is None \
            and first.seed_state_at is None:
        return first
    lengths, splits, source, slots, outs, split_outs = [], [], [], [], [], []
    buffered = 0
    for part in (first, then):
        if part is not None:
            lengths += part.seq_len.tolist()
            splits += [None if r < 0 else r for r in part.split_row.tolist()]
            source += part.source.tolist()
            slots += part.slot.tolist()
            out = part.out_row.tolist() if part.out_row is not None else [-1 - s for s in range(part.count)]
            outs += [r if r >= 0 else r - buffered for r in out]     # `then`'s buffer rows after `first`'s
            buffered += part.buffered
            split_outs += part.split_out_row.tolist() if part.split_out_row is not None \
                else [-1 - j for j in range(part.splits)]
    joins = [] if first is None else list(zip(first.join_seq.tolist(), first.join_live.tolist(), strict=True))
    before = 0 if first is None else first.count
    seeds = (None, None)
    if then is not None:
        seeds = tuple(None if at is None else [-1] * before + at.tolist()
                      for at in (then.seed_hist_at, then.seed_state_at))
    return packed_sequences(lengths, splits, source, slots, joins, seeds, joins_after=before,
                            out_rows=(outs, split_outs))
