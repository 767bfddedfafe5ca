"""GDN states at chosen rows of a step's packed sequences (issue 41): besides its final state, the conv
history and recurrent state after each chosen row of a multi-row sequence, exactly what running the
sequence cut after that row ends with (docs/mechanism.md §5.8).

The native kernel, which runs each sequence token by token, copies them out as it passes the rows
(ops/gdn_kernel.py `GDNKernel`, `captures`). The chunked rules (torch, fla) take them by replay
(ReplaySSM-style, `states_at_rows`): after a layer's op, the rows up to each sequence's chosen rows run
again through the same backend's `varlen` op, in *rounds* that chain. Round 0 runs each sequence's rows
up to its first chosen row from the state it started from (its slot's committed state, which the step's
op reads and never writes); round k runs the rows after its k-th chosen row up to its (k+1)-th from round
k-1's states. Every row before a sequence's last chosen row runs once more, the projections and MLPs
never do, and the step's own op stays as it is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from .gdn_layout import VarlenLayout, varlen_layout
from .gdn_op_types import VarlenOp
from .gdn_sequences import PackedSequences


@dataclass
class RowCaptures:
    """The replay rounds of the chosen rows of some packed sequences."""

    first: Tensor                   # [N + 1] sequence s's chosen rows are rows[first[s]:first[s + 1]]
    rows: Tensor                    # [M] the chosen rows, sequence by sequence, ascending (int64, on the CPU)
    rounds: list[VarlenLayout]      # round k: one piece per sequence with more than k chosen rows
    order: Tensor                   # [M] each chosen row's state among the rounds' outputs, concatenated
    step_rows: int                  # rows of the step's inputs the rounds read (1 + the largest)


def row_captures(seqs: PackedSequences, rows: list[list[int]], kernel: int, chunk_size: int = 64,
                 device: torch.device | str = "cpu") -> RowCaptures:
    """The states after packed rows `rows[s]` of each sequence s of `seqs` (row i of a sequence: its
    (i+1)-th packed row, appended rows included; ascending, 0 <= i < its length), sequence by sequence,
    and the rounds that replay them."""
    if len(rows) != seqs.count:
        raise ValueError(f"row_captures: {len(rows)} row lists for {seqs.count} sequences")
    source, starts = seqs.source.tolist(), seqs.seq_start.tolist()
    lengths, slots = seqs.seq_len.tolist(), seqs.slot.tolist()
    chosen = [list(r) for r in rows]
    for s, at in enumerate(chosen):
        if at and (at != sorted(set(at)) or not 0 <= at[0] <= at[-1] < lengths[s]):
            raise ValueError(f"row_captures: sequence {s} has {lengths[s]} rows, rows {at} chosen (ascending)")
    flat: dict[tuple[int, int], int] = {}       # (sequence, row) -> its state among the rounds' outputs
    rounds: list[VarlenLayout] = []
    previous: dict[int, int] = {}               # sequence -> its piece in the previous round
    done = 0
    for k in range(max(map(len, chosen), default=0)):
        piece_lengths, piece_source, piece_slots, piece = [], [], [], {}
        for s, at in enumerate(chosen):
            if len(at) <= k:
                continue
            first = 0 if k == 0 else at[k - 1] + 1
            piece[s] = len(piece_lengths)
            flat[(s, at[k])] = done + piece[s]
            piece_lengths.append(at[k] + 1 - first)
            piece_source += source[starts[s] + first:starts[s] + at[k] + 1]
            piece_slots.append(slots[s] if k == 0 else previous[s])
        rounds.append(varlen_layout(piece_lengths, kernel, chunk_size=chunk_size, device=device,
                                    source=piece_source, slots=piece_slots))
        done += len(piece_lengths)
        previous = piece
    order = torch.tensor([flat[(s, i)] for s, at in enumerate(chosen) for i in at], dtype=torch.long, device=device)
    first = torch.tensor([0, *itertools.accumulate(map(len, chosen))], dtype=torch.long)
    every = torch.tensor([i for at in chosen for i in at], dtype=torch.long)
    return RowCaptures(first, every, rounds, order, seqs.step_rows_needed)


def states_at_rows(varlen: VarlenOp, captures: RowCaptures, u: Tensor, g: Tensor, beta: Tensor,
                   extra: tuple[Tensor, Tensor, Tensor] | None, conv_weight: Tensor, conv_pool: Tensor,
                   ssm_pool: Tensor, key_heads: int, key_dim: int) -> tuple[Tensor, Tensor]:
    """The conv histories `[M, K-1, C]` and states `[M, H, Dk, Dv]` after the chosen rows of `captures`,
    by one layer's `varlen` op (a backend's `GDNOps.varlen`) over the step's rows `u, g, beta` and appended
    rows `extra`, as the step's own call of it read them; `conv_pool`, `ssm_pool` the layer's pools, whose
    rows the sequences started from (read, never written)."""
    heads, dv = ssm_pool.shape[1], ssm_pool.shape[3]
    dropped = torch.empty(max(captures.step_rows, 1), heads, dv, dtype=torch.float32, device=u.device)
    hists, states = [], []
    for layout in captures.rounds:
        finals, _, tails, _, _ = varlen(u, g, beta, extra, conv_weight, conv_pool, ssm_pool, layout, key_heads,
                                        key_dim, dropped)
        hists.append(tails)
        states.append(finals)
        conv_pool, ssm_pool = tails, finals     # the next round starts where this one ends
    if not states:
        return conv_pool[:0], ssm_pool[:0].float()
    return torch.cat(hists)[captures.order], torch.cat(states)[captures.order]
