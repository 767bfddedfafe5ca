"""Gated DeltaNet kernels over packed sequences (the layout flash-linear-attention calls `cu_seqlens`).

A step packs the rows of many sequences one after another; each sequence starts from its own conv
history and recurrent state (read from the engine's pools by row) and ends with its own, which goes
into the pool row the layout names for it (the other row of its slot, which the step's update makes
current: cache/gdn_state.py) or, where it names none, is returned (`place`). Nothing here loops over
sequences in Python. Where the rows go is the step's `VarlenLayout` (ops/gdn_layout.py), built once
per step. The ops over it are one layer's, by backend: here the torch
path, `gated_deltanet_varlen` for multi-row sequences with the deferred joins (the short convolution as
K gathered multiply-adds over all rows, and the chunked delta rule, which batches every block of every
sequence and scans only over block *steps*: the longest sequence's block count; ops/gdn_varlen_torch.py)
and `gated_deltanet_rows` for one-row sequences (decode rows: one batched recurrent step); the native
kernel's of the same names and arguments are in ops/gdn_kernel.py, and which a step runs is chosen once
per step (ops/backend.py).

A sequence may carry a *split*: the state and conv history after its first `split` rows are returned
too. The deferred-prefill join uses it: a deferred chunk runs with its turn's first generated tokens
(the conv lead) appended, and needs both the state after the chunk (the new prefix) and after the lead
(docs/mechanism.md §5). The split starts a new block, so its state falls out of the scan.

State layout as in ops/gdn.py: `S [H, Dk, Dv]` fp32, a token acts as `S ← e^g S; S ← S + k ⊗ β(v − Sᵀk)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from . import gdn_state_map
from .gdn import split_qkv
from .gdn_layout import VarlenLayout
from .gdn_varlen_torch import causal_conv1d_varlen, chunk_gated_delta_rule_varlen, conv_step, gated_delta_step


@dataclass(frozen=True)
class PooledKernels:
    """One-token kernels on the pool's rows in place, by row index (ops/gdn_triton.py `POOLED`): the short
    convolution, `conv(u, weight, conv_pool, read, write) -> out`, and the delta rule, `step(q, k, v, g,
    beta, ssm_pool, read, write) -> o`."""

    conv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    step: Callable[..., Tensor]


# the layout parts (`VarlenLayout`'s lazily built tensors) `gated_deltanet_varlen` and `gated_deltanet_rows`
# read whatever their delta rule: on the GPU path they are laid out with the step's other staged tensors
# (ops/uploads.py) rather than copied one by one where the forward first reads them
VARLEN_PARTS = ("slots", "gathers", "idle", "conv", "join_slots", "join_seqs", "targets")
ROWS_PARTS = ("source_rows", "slots", "seed_rows", "targets")


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
    (S_lead' − S_lead_j)`, with `maps` = (P `[J, H, Dk, Dk]`, S_lead `[J, H, Dk, Dv]`). New states go
    to the pool rows the layout names (`PackedSequences.out_row`); returns the others: (final states,
    states at the splits or None, histories after each sequence, histories at the splits or None, in
    buffer-row order, see `place`; corrected live states or None); nothing else is modified. `rule`: the
    delta rule over the packed rows (another backend's, ops/fla_adapter.py, takes the same arguments).

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
    if layout.idle is not None:     # idle rows (a padded step's fill): no decay, no update
        gm.masked_fill_(layout.idle, 0.0)
        bm.masked_fill_(layout.idle, 0.0)
    conv, tails, split_tails = causal_conv1d_varlen(um, conv_weight, history, layout)
    q, k, v = split_qkv(conv, key_heads, key_dim, heads, dv)
    o, finals, split_states = rule(q, k, v, gm, bm, state, layout)
    out[step_rows] = o[at].to(out.dtype)
    corrected = None
    if seqs.joins:
        p, s_ref = maps
        live = ssm_pool.index_select(0, layout.join_slots)
        corrected = gdn_state_map.join_state(live.float(), p, finals[layout.join_seqs] - s_ref)
    return (*place(layout, conv_pool, ssm_pool, finals, split_states, tails, split_tails), corrected)


def gated_deltanet_rows(u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor, conv_pool: Tensor,
                        ssm_pool: Tensor, layout: VarlenLayout, key_heads: int, key_dim: int, out: Tensor,
                        seeds: tuple[Tensor | None, Tensor | None] = (None, None), factors: bool = False,
                        step: Callable[..., tuple[Tensor, Tensor]] = gated_delta_step,
                        pooled: PooledKernels | None = None,
                        ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """`gated_deltanet_varlen` for one-row sequences (decode rows): sequence s is step row
    `layout.seqs.source[s]` and starts from pool slot `layout.seqs.slot[s]`, or from row
    `seed_hist_at[s]` / `seed_state_at[s]` of `seeds` = (histories `[M, K-1, C]`, states `[M', H, Dk,
    Dv]`) where the layout names one (a live state a join corrected in this step). Writes the rows'
    outputs to `out` and their new states to the pool rows the layout names; returns (the histories and
    states after each row it names none for, see `place`, and with `factors` the rows' k per key head `[N,
    key_heads, Dk]` and v `[N, H, Dv]` as the delta rule read them). Nothing else is modified. `step`:
    the one-token delta rule (another backend's takes the same arguments). `pooled`, where the layout
    names a pool row for every new state: one-token kernels on the pool's rows in place instead, which
    read each history and state from the row the layout names and write the new ones into its output
    row; nothing is gathered or placed (a seeded row's seed is put in its output row and read there).

    One batched recurrent step."""
    heads, dv = ssm_pool.shape[1], ssm_pool.shape[3]
    rows = layout.step_rows(u.shape[0])
    us, gs, bs = (u, g, beta) if rows is None else (u[rows], g[rows], beta[rows])
    if pooled is not None and layout.seqs.out_row is not None and not layout.seqs.buffered:
        write = layout.targets[0].pool_rows     # every sequence's, in order
        reads = []
        for pool, seed, at in zip((conv_pool, ssm_pool), seeds, layout.seed_rows, strict=True):
            read = layout.slots
            if at is not None:
                pool[write[at[0]]] = seed[at[1]].to(pool.dtype)
                read = read.clone()
                read[at[0]] = write[at[0]]
            reads.append(read)
        q, k, v = split_qkv(pooled.conv(us, conv_weight, conv_pool, reads[0], write), key_heads, key_dim, heads, dv)
        o = pooled.step(q, k, v, gs, bs, ssm_pool, reads[1], write)
        finals, tails = ssm_pool[:0], conv_pool[:0]       # none outside the pool
    else:
        hist, state = conv_pool.index_select(0, layout.slots), ssm_pool.index_select(0, layout.slots)
        for target, seed, at in zip((hist, state), seeds, layout.seed_rows, strict=True):
            if at is not None:
                target[at[0]] = seed[at[1]].to(target.dtype)
        conv, new_hist = conv_step(us, conv_weight, hist)
        q, k, v = split_qkv(conv, key_heads, key_dim, heads, dv)
        o, state = step(q, k, v, gs, bs, state)      # `state` is a gathered copy, which it may update in place
        finals, _, tails, _ = place(layout, conv_pool, ssm_pool, state, None, new_hist, None)
    if rows is None:
        out.copy_(o)
    else:
        out[rows] = o.to(out.dtype)
    return tails, finals, (k[:, ::heads // key_heads], v) if factors else None   # split_qkv repeated k per value head


def place(layout: VarlenLayout, conv_pool: Tensor, ssm_pool: Tensor, finals: Tensor, split_states: Tensor | None,
          tails: Tensor, split_tails: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """The new states of the layout's sequences and splits, computed here as tensors: those it names a pool
    row for are written there (a layer's views of the pools, `conv_pool [rows, K-1, C]`, `ssm_pool [rows,
    H, Dk, Dv]`), the others returned in buffer-row order (`PackedSequences.out_row`; all of them, in
    order, where the layout names no rows)."""
    if layout.seqs.out_row is None:
        return finals, split_states, tails, split_tails
    kept = []
    for target, (state, hist) in zip(layout.targets, ((finals, tails), (split_states, split_tails)), strict=True):
        if state is None:
            kept += [None, None]
            continue
        if len(target.pool_at):
            every = not len(target.buffer_at)      # then pool_at is every output, in order
            ssm_pool[target.pool_rows] = state if every else state[target.pool_at]
            conv_pool[target.pool_rows] = (hist if every else hist[target.pool_at]).to(conv_pool.dtype)
        kept += [state[target.buffer_at], hist[target.buffer_at]]
    return kept[0], kept[2], kept[1], kept[3]
