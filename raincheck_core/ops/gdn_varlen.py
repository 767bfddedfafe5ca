"""Gated DeltaNet kernels over packed sequences (the layout flash-linear-attention calls `cu_seqlens`).

A step packs the rows of many sequences one after another; each sequence starts from its own conv
history and recurrent state (read from the engine's pools by slot, never written) and ends with its
own. Nothing here loops over sequences in Python. `VarlenLayout` is where the rows go, built once per
step. The ops over it are one layer's, by backend: here the torch path, `gated_deltanet_varlen` for
multi-row sequences with the deferred joins (the short convolution as K gathered multiply-adds over all
rows, and the chunked delta rule, which batches every block of every sequence and scans only over block
*steps*: the longest sequence's block count; ops/gdn_varlen_torch.py) and `gated_deltanet_rows` for
one-row sequences (decode rows: one batched recurrent step); the native kernel's of the same names and
arguments are in ops/gdn_kernel.py, and which a step runs is chosen once per step (ops/backend.py).

A sequence may carry a *split*: the state and conv history after its first `split` rows are returned
too. The deferred-prefill join uses it: a deferred chunk runs with its turn's first generated tokens
(the conv lead) appended, and needs both the state after the chunk (the new prefix) and after the lead
(docs/mechanism.md §5). The split starts a new block, so its state falls out of the scan.

State layout as in ops/gdn.py: `S [H, Dk, Dv]` fp32, a token acts as `S ← e^g S; S ← S + k ⊗ β(v − Sᵀk)`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from . import gdn_kernel, gdn_state_map
from .gdn import split_qkv
from .gdn_varlen_torch import causal_conv1d_varlen, chunk_gated_delta_rule_varlen, conv_step, gated_delta_step


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
class VarlenLayout:
    """Where the rows of N packed sequences go; built once per step, shared by every GDN layer. What
    only the torch path reads (the conv layout, the chunked rule's blocks, the gathers) is laid out on
    first use: the native kernel reads `seqs` alone."""

    num_seqs: int
    kernel: int
    # sequences: where each packed row is read from (a step row, or an appended row: a deferred chunk's
    # recorded conv lead), first rows, lengths, splits; what the native kernel reads
    seqs: gdn_kernel.PackedSequences
    chunk_size: int = 64
    device: torch.device | str = "cpu"

    @cached_property
    def conv(self) -> ConvLayout:
        lead, n = self.kernel - 1, self.num_seqs
        lens, seq_start = self.seqs.seq_len, self.seqs.seq_start
        ext_start = seq_start + torch.arange(n) * lead                  # where each history begins
        hist_at = (ext_start[:, None] + torch.arange(lead)[None, :]).flatten()
        row_seq = torch.repeat_interleave(torch.arange(n), lens)
        row_at = torch.arange(int(lens.sum())) + (row_seq + 1) * lead
        tail_at = (ext_start + lens)[:, None] + torch.arange(lead)[None, :]
        split_tail_at = None
        split_ids = (self.seqs.split_row >= 0).nonzero().flatten()
        if len(split_ids):
            ends = ext_start[split_ids] + self.seqs.split_row[split_ids]
            split_tail_at = (ends[:, None] + torch.arange(lead)[None, :]).to(self.device)
        return ConvLayout(int(lens.sum()) + n * lead, hist_at.to(self.device), row_at.to(self.device),
                          tail_at.to(self.device), split_tail_at)

    @cached_property
    def blocks(self) -> BlockLayout:
        splits = [None if r < 0 else r for r in self.seqs.split_row.tolist()]
        return _block_layout(self.seqs.seq_len.tolist(), splits, self.chunk_size, self.device)

    @cached_property
    def runs(self) -> SplitRuns:
        """The sequences as runs without splits, on the layout's device (built once per step)."""
        lens, splits = self.seqs.seq_len, self.seqs.split_row
        starts = self.seqs.seq_start
        first = torch.where(splits >= 0, splits, lens)
        split_seqs = (splits >= 0).nonzero().flatten()
        rest = (lens - first)[split_seqs]
        more = split_seqs[rest > 0]
        rest, dev = rest[rest > 0], self.device
        return SplitRuns(_run_rows(starts, first).to(dev), cumulative(first).to(dev),
                         split_seqs.to(dev) if len(split_seqs) else None, more.to(dev),
                         _run_rows(starts[more] + first[more], rest).to(dev), cumulative(rest).to(dev))

    @cached_property
    def slots(self) -> Tensor:
        """`seqs.slot` on the layout's device: the pool slot each sequence starts from."""
        return self.seqs.slot.to(self.device)

    @cached_property
    def join_seqs(self) -> Tensor:
        """`seqs.join_seq` on the layout's device: the sequence whose final state drives each join."""
        return self.seqs.join_seq.to(self.device)

    @cached_property
    def join_slots(self) -> Tensor:
        """`seqs.join_live` on the layout's device: the pool slot of the live state each join corrects."""
        return self.seqs.join_live.to(self.device)

    @cached_property
    def seed_rows(self) -> tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None]:
        """For the torch path: (sequences, seed rows) of the sequences that start from a seed history /
        seed state instead of their slot's, or None."""
        def pairs(at: Tensor | None) -> tuple[Tensor, Tensor] | None:
            if at is None or not bool((at >= 0).any()):
                return None
            seqs = (at >= 0).nonzero().flatten()
            return seqs.to(self.device), at[seqs].to(self.device)
        return pairs(self.seqs.seed_hist_at), pairs(self.seqs.seed_state_at)

    @cached_property
    def step_rows(self) -> Tensor | None:
        """For one-row sequences: the step row of each, or None when they are exactly the step's rows in
        order (a decode-only step: no gather, no scatter)."""
        return None if self.seqs.in_order else self.seqs.source.to(self.device)

    @cached_property
    def gathers(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For the torch path, once per step: (packed rows read from the step, those step rows, packed
        rows appended, their appended-row indices)."""
        source = self.seqs.source.to(self.device)
        at = (source >= 0).nonzero().flatten()
        appended = (source < 0).nonzero().flatten()
        return at, source[at], appended, -1 - source[appended]


def _run_rows(starts: Tensor, lengths: Tensor) -> Tensor:
    """The packed rows of runs starting at `starts` of `lengths` rows, run after run."""
    return torch.repeat_interleave(starts - cumulative(lengths)[:-1], lengths) + torch.arange(int(lengths.sum()))


def cumulative(lengths: Tensor) -> Tensor:
    """`[0, l0, l0 + l1, ...]` (int64): sequence lengths as fla's `cu_seqlens`."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).long()


def varlen_layout(lengths: list[int], kernel: int, splits: list[int | None] | None = None,
                  chunk_size: int = 64, device: torch.device | str = "cpu", source: Tensor | list[int] | None = None,
                  slots: list[int] | None = None, joins: list[tuple[int, int]] | None = None,
                  seeds: tuple[list[int] | None, list[int] | None] | None = None) -> VarlenLayout:
    """Layout of sequences of `lengths` rows; `splits[s]` (or None) marks a split after that many rows;
    `source` says where each packed row is read from (see `VarlenLayout.source`; default: step row r);
    `slots` the state-pool slot each sequence starts from (default: slot s); `joins` (sequence, live
    slot) of each join (see `gated_deltanet_varlen`); `seeds` the seed rows sequences start from (see
    `gated_deltanet_rows`)."""
    splits = splits or [None] * len(lengths)
    for s, split in enumerate(splits):
        if split == 0:      # the state after zero rows would be the initial one
            raise ValueError(f"split after 0 rows is not supported (sequence {s})")
    return VarlenLayout(num_seqs=len(lengths), kernel=kernel,
                        seqs=gdn_kernel.packed_sequences(lengths, splits, source, slots, joins, seeds),
                        chunk_size=chunk_size, device=device)


def _block_layout(lengths: list[int], splits: list[int | None], chunk_size: int, device: torch.device | str
                  ) -> BlockLayout:
    """Every part of every sequence starts a block. Blocks are numbered step-major (every sequence's first
    block, then every second block, ...), so that each scan step's blocks are one contiguous range, read
    and written as views rather than gathered."""
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
        steps.append((slice(at, at + len(ids)), torch.tensor(seqs, dtype=torch.long, device=device),
                      seqs == list(range(n))))
        pos = [(k, split_of[i]) for k, i in enumerate(ids) if i in split_of]
        captures.append((torch.tensor([p for p, _ in pos], dtype=torch.long, device=device),
                         torch.tensor([j for _, j in pos], dtype=torch.long, device=device)))
        at += len(ids)
    return BlockLayout(chunk=chunk, num_blocks=len(blocks), row_slot=row_slot.to(device), steps=steps,
                       captures=captures)


def gated_deltanet_varlen(u: Tensor, g: Tensor, beta: Tensor, extra: tuple[Tensor, Tensor, Tensor] | None,
                          conv_weight: Tensor, conv_pool: Tensor, ssm_pool: Tensor, layout: VarlenLayout,
                          key_heads: int, key_dim: int, out: Tensor, maps: tuple[Tensor, Tensor] | None = None,
                          rule: Callable[..., tuple[Tensor, Tensor, Tensor | None]] = chunk_gated_delta_rule_varlen,
                          ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None]:
    """A Gated DeltaNet layer's token mixing of packed sequences: the short convolution, `split_qkv` and
    the delta rule, then the deferred joins. Packed row r is row `layout.seqs.source[r]` of the step's
    pre-conv rows `u [R, C]` and gates `g, beta [R, H]`, or for `source[r] < 0` appended row
    `-1 - source[r]` of `extra` = (u, g, beta) (a deferred chunk's recorded conv lead); its output is
    written to row `source[r]` of `out [R, H, Dv]` (an appended row's is dropped). Conv weight `[C, K]`;
    sequence s starts from row `layout.seqs.slot[s]` of the layer's pools `conv_pool [slots, K-1, C]` and
    `ssm_pool [slots, H, Dk, Dv]` (read, never written); `key_heads` key heads of `key_dim`. Each join j
    of the layout corrects the live state in pool slot `join_live[j]` by the final state of sequence
    `join_seq[j]` (its chunk run from the prefix state with the lead appended: S_lead'): `live + P_j
    (S_lead' − S_lead_j)`, with `maps` = (P `[J, H, Dk, Dk]`, S_lead `[J, H, Dk, Dv]`). Returns (final
    states, states at the splits or None, histories after each sequence, histories at the splits or
    None, corrected live states or None); inputs are not modified. `rule`: the delta rule over the packed
    rows (another backend's, ops/fla_adapter.py, takes the same arguments).

    The torch ops with the chunked rule. The native kernel's version (ops/gdn_kernel.py, token by token,
    reading the rows and the pools' states where they lie) is 5-8x faster at 10-1,000 rows on one thread,
    `bench` shapes (`python -m bench.kernels`, docs/BENCHMARKS.md)."""
    heads, dv = ssm_pool.shape[1], ssm_pool.shape[3]
    seqs = layout.seqs
    history, state = conv_pool.index_select(0, layout.slots), ssm_pool.index_select(0, layout.slots)
    at, step_rows, appended, e = layout.gathers
    rows = seqs.source.shape[0]
    um = u.new_empty(rows, u.shape[1])
    gm, bm = g.new_empty(rows, g.shape[1]), beta.new_empty(rows, beta.shape[1])
    um[at], gm[at], bm[at] = u[step_rows], g[step_rows], beta[step_rows]
    if len(appended):
        um[appended] = extra[0][e].to(u.dtype)
        gm[appended], bm[appended] = extra[1][e].to(g.dtype), extra[2][e].to(beta.dtype)
    conv, tails, split_tails = causal_conv1d_varlen(um, conv_weight, history, layout)
    q, k, v = split_qkv(conv, key_heads, key_dim, heads, dv)
    o, finals, split_states = rule(q, k, v, gm, bm, state, layout)
    out[step_rows] = o[at].to(out.dtype)
    corrected = None
    if seqs.joins:
        p, s_ref = maps
        live = ssm_pool.index_select(0, layout.join_slots)
        corrected = gdn_state_map.join_state(live.float(), p, finals[layout.join_seqs] - s_ref)
    return finals, split_states, tails, split_tails, corrected


def gated_deltanet_rows(u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor, conv_pool: Tensor,
                        ssm_pool: Tensor, layout: VarlenLayout, key_heads: int, key_dim: int, out: Tensor,
                        seeds: tuple[Tensor | None, Tensor | None] = (None, None), factors: bool = False,
                        step: Callable[..., Tensor] = gated_delta_step,
                        ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """`gated_deltanet_varlen` for one-row sequences (decode rows): sequence s is step row
    `layout.seqs.source[s]` and starts from pool slot `layout.seqs.slot[s]`, or from row
    `seed_hist_at[s]` / `seed_state_at[s]` of `seeds` = (histories `[M, K-1, C]`, states `[M', H, Dk,
    Dv]`) where the layout names one (a live state a join corrected in this step). Writes the rows'
    outputs to `out`; returns (the histories and states after each row, and with `factors` the rows' k
    per key head `[N, key_heads, Dk]` and v `[N, H, Dv]` as the delta rule read them). Nothing else is
    modified. `step`: the one-token delta rule (another backend's takes the same arguments).

    One batched recurrent step."""
    heads, dv = ssm_pool.shape[1], ssm_pool.shape[3]
    hist, state = conv_pool.index_select(0, layout.slots), ssm_pool.index_select(0, layout.slots)
    for target, seed, at in zip((hist, state), seeds, layout.seed_rows, strict=True):
        if at is not None:
            target[at[0]] = seed[at[1]].to(target.dtype)
    rows = layout.step_rows
    us, gs, bs = (u, g, beta) if rows is None else (u[rows], g[rows], beta[rows])
    conv, new_hist = conv_step(us, conv_weight, hist)
    q, k, v = split_qkv(conv, key_heads, key_dim, heads, dv)
    o = step(q, k, v, gs, bs, state)      # `state` is a gathered copy: updated in place
    if rows is None:
        out.copy_(o)
    else:
        out[rows] = o.to(out.dtype)
    return new_hist, state, (k[:, ::heads // key_heads], v) if factors else None   # split_qkv repeated k per value head
