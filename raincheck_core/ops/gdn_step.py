"""A step's Gated DeltaNet work, laid out once per step and shared by every GDN layer, and the op that
runs a layer of it.

The runner splits the step's sequences into two groups (`GDNStep`):
- `multi`: sequences of several rows (prefill and deferred chunks), with the deferred joins;
- `single`: one-row sequences (decode rows), *after* `multi`, because a decode row may start from a
  state that `multi` just corrected (see `GDNCorrections`).
The step's op set (ops/backend.py) then prepares its op (`GDNStep.op`, a `GDNLayerOp`) and the buffers
the op writes: on the native path both groups in one kernel call per layer, the joins between them
(`FusedGDN`); otherwise the groups one after the other, each by the implementation that takes it
(`GroupedGDN`). Each sequence reads its state from its slot's current pool row and writes its new one
into the other row of its slot (the rows its layout names: `PackedSequences.out_row`), which the engine's
update makes current (cache/gdn_state.py): a forward that fails half-way leaves every current state as
it was, and nothing is copied back. What has no pool row of its own (a joined chunk's state after its
lead, `S_lead'`, and the joins' corrected live states) goes to `GDNOutputs` (buffers that hold every
layer's rows, `[rows, layers, ...]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..cache.gdn_state import GDNStatePool
from .gdn_kernel import GDNBuffers, GDNKernel
from .gdn_layout import VarlenLayout
from .gdn_op_types import RowsOp, VarlenOp
from .gdn_rows import RowCaptures, states_at_rows
from .gdn_sequences import PackedSequences, fused_sequences


@dataclass(frozen=True)
class InPlace:
    """Which states of a group its kernels read and write in the pool's rows, by index; the others are
    gathered out of the pool and the new ones placed back by copies (ops/gdn_varlen.py `place`;
    ops/gdn_traffic.py counts them)."""

    conv: bool
    state: bool


COPIED, IN_PLACE = InPlace(False, False), InPlace(True, True)



@dataclass
class GDNMulti:
    """Multi-row sequences. Packed in the group: each sequence's step rows, then its appended rows."""

    layout: VarlenLayout    # its `seqs.source`: per packed row the step row it is, or -1 - e for appended
                            # row e (recorded inputs, not step rows: `GDNCorrections.extra_*[:, e]`); the
                            # slots sequences start from, and the joins (sequence, corrected slot)


@dataclass
class GDNCorrections:
    """Affine corrections of some states, computed after `multi`: `S_j + P_j (F_j − S_ref_j)` where `F_j`
    is the final state of `multi` sequence `layout.join_seqs[j]` (which runs the appended rows last) and
    `S_j` the live state in slot `layout.join_slots[j]` (`GDNMulti.layout`). The deferred join
    (docs/mechanism.md §5): a deferred chunk with the turn's conv lead appended."""

    p: torch.Tensor                  # [J, layers, H, Dk, Dk] fp32
    s_ref: torch.Tensor              # [J, layers, H, Dk, Dv] fp32
    extra_u: torch.Tensor | None     # [layers, T, conv dim] appended rows' pre-conv inputs (all J, packed)
    extra_g: torch.Tensor | None     # [layers, T, H]
    extra_beta: torch.Tensor | None  # [layers, T, H]


@dataclass
class GDNSingle:
    layout: VarlenLayout             # one-row sequences: their step rows, slots, and seed rows (a decode row
                                     # of a turn whose chunk joined in this step starts from the corrected
                                     # state: `GDNCorrections` j; within the lead, from multi's conv tail)
    # the rows' factors (u, k, v, g, beta) are kept: some row is tracked, and the runner picks the
    # tracked rows' out of them after the forward (which rows is no part of a graph's shapes)
    factors: bool


@dataclass
class GDNOutputs:
    """The step's new GDN states that have no pool row (`PackedSequences.out_row`), every layer's rows side
    by side, and the one-row sequences' factors."""

    multi: GDNBuffers | None = None         # finals, tails, split states and tails, corrected live states
    single: GDNBuffers | None = None        # finals, tails (none where every decode row writes its pool row)
    x: torch.Tensor | None = None           # [layers, R, C] step rows' [q | k | v] (native, tracked rows)
    # per layer: u, k, v, g, beta of the one-row sequences
    factors: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    # per layer: u, g, beta of the step rows in `GDNStep.input_rows` (input rows extending a join's map)
    input_factors: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    # the conv histories [M, layers, K-1, C] and states [M, layers, H, Dk, Dv] after the chosen rows of
    # `GDNStep.at_rows`, fp32
    at_rows: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class AtRows:
    """Chosen rows of the multi-row sequences whose states a step returns besides the final ones
    (ops/gdn_rows.py), and the step's backend op that replays them."""

    captures: RowCaptures
    varlen: VarlenOp                # the step's op set's (`GDNOps.varlen`)
    key_heads: int


class GDNLayerOp(Protocol):
    in_place: tuple[InPlace, InPlace]     # per group (multi, single)
    takes_rows: bool                      # it writes the states at `GDNStep.at_rows` itself (else: replay)

    def __call__(self, step: GDNStep, layer: int, u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                 out: Tensor) -> None:
        """GDN layer `layer`'s token mixing of `step`: its pre-conv rows `u [R, C]`, gates `g, beta [R, H]`
        and conv weight `[C, K]`; outputs to `out [R, H, Dv]`, new states to the step's buffers. The op is
        handed its step rather than holding it: a step holding an op that held the step would be a cycle,
        and its buffers would wait for the garbage collector instead of going with the step."""


@dataclass
class GDNStep:
    pool: GDNStatePool
    multi: GDNMulti | None = None
    corrections: GDNCorrections | None = None
    single: GDNSingle | None = None
    out: GDNOutputs = field(default_factory=GDNOutputs)
    op: GDNLayerOp | None = None    # prepared by the step's op set (ops/backend.py `GDNOps.prepare`)
    input_rows: Tensor | None = None    # step rows of multi-row input whose factors a pending join needs
    at_rows: AtRows | None = None       # states wanted after chosen rows of `multi`'s sequences

    def layer(self, layer: int, u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor, out: Tensor) -> None:
        """Run GDN layer `layer` of the step by its prepared op (`GDNLayerOp`), then replay the chosen rows
        (`at_rows`) from the states the sequences started from, which the op leaves as they were."""
        self.op(self, layer, u, g, beta, conv_weight, out)
        if self.at_rows is not None and not self.op.takes_rows:
            a, c, i = self.at_rows, self.corrections, layer
            extra = (c.extra_u[i], c.extra_g[i], c.extra_beta[i]) if c is not None and c.extra_u is not None else None
            for buf, t in zip(self.out.at_rows, states_at_rows(
                    a.varlen, a.captures, u, g, beta, extra, conv_weight, self.pool.conv.rows[:, i],
                    self.pool.ssm.rows[:, i], a.key_heads, self.pool.ssm.shape[3]), strict=True):
                buf[:, i] = t

    def after_layer(self, u: Tensor, g: Tensor, beta: Tensor) -> None:
        """Keep what the runner reads of a layer besides the states: the tracked input rows' u, g, beta."""
        if self.input_rows is not None:
            rows = self.input_rows
            self.out.input_factors.append((u[rows], g[rows], beta[rows]))

    def keep_factors(self, u: Tensor, g: Tensor, beta: Tensor, k: Tensor | None, v: Tensor | None) -> None:
        """A layer's u, g, beta of every one-row sequence, with k and v where the op does not leave them in
        `out.x` (the runner picks the tracked rows once)."""
        rows = self.single.layout.step_rows(u.shape[0])
        us, gs, bs = (u, g, beta) if rows is None else (u[rows], g[rows], beta[rows])
        self.out.factors.append((us, k, v, gs, bs))


def buffers(pool: GDNStatePool, seqs: PackedSequences) -> GDNBuffers:
    """Empty output buffers for `seqs`, every layer of the pool's rows side by side."""
    return GDNBuffers.empty(seqs, pool.conv.shape[1], tuple(pool.conv.shape[2:]), tuple(pool.ssm.shape[2:]),
                            pool.conv.device)


def row_buffers(step: GDNStep) -> tuple[Tensor, Tensor] | None:
    """Empty buffers for the states at the step's chosen rows (`GDNOutputs.at_rows`), or None: none chosen."""
    if step.at_rows is None:
        return None
    m, pool = step.at_rows.captures.rows.shape[0], step.pool
    return tuple(torch.empty(m, *t.shape[1:], dtype=torch.float32, device=t.device) for t in (pool.conv, pool.ssm))


class FusedGDN:
    """Both groups in one native call per layer (a `GDNKernel` prepared once for the step): the chunks'
    sequences, then the joins, then the decode rows, which start from the states the joins just
    corrected while those are in cache (seeds into the call's own outputs)."""

    def __init__(self, step: GDNStep, key_heads: int):
        seqs = fused_sequences(None if step.multi is None else step.multi.layout.seqs,
                               None if step.single is None else step.single.layout.seqs)
        out, c = buffers(step.pool, seqs), step.corrections
        captures = None
        step.out.at_rows = row_buffers(step)
        if step.at_rows is not None:      # the multi-row sequences come first; the decode rows choose none
            first = step.at_rows.captures.first
            first = torch.cat([first, first[-1:].expand(seqs.count + 1 - len(first))])
            captures = (first, step.at_rows.captures.rows, *step.out.at_rows)
        self.kernel = GDNKernel(
            seqs, step.pool.conv.rows, step.pool.ssm.rows, key_heads, out,
            extra=(c.extra_u, c.extra_g, c.extra_beta) if c is not None and c.extra_u is not None else None,
            maps=(c.p, c.s_ref) if c is not None else None,
            seeds=(out.tails, out.corrected) if seqs.seed_state_at is not None else (None, None), captures=captures)
        self.takes_rows = True
        multi, single = out.split(0 if step.multi is None else step.multi.layout.seqs.buffered)
        step.out.multi = multi if step.multi is not None else None
        step.out.single = single if step.single is not None else None
        self.in_place = (IN_PLACE, IN_PLACE)
        self.factors = step.single is not None and step.single.factors
        if self.factors:    # the kernel hands over the tracked rows' k, v as each row's [q | k | v]
            step.out.x = torch.empty(self.kernel.layers, seqs.step_rows_needed, self.kernel.channels)

    def __call__(self, step: GDNStep, layer: int, u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                 out: Tensor) -> None:
        self.kernel(layer, u, g, beta, conv_weight, out, step.out.x[layer] if self.factors else None)
        if self.factors:            # k and v of the tracked rows stay in `step.out.x` for the runner
            step.keep_factors(u, g, beta, None, None)
        step.after_layer(u, g, beta)


class GroupedGDN:
    """The groups one after the other, each layer's: the multi-row sequences with the joins (`varlen`),
    then the one-row sequences (`rows`); those of a turn whose chunk joined in this step start from the
    corrected state (and, within the lead, the chunk's conv tail): the layout's seed rows."""

    def __init__(self, step: GDNStep, key_heads: int, varlen: VarlenOp, rows: RowsOp,
                 in_place: tuple[InPlace, InPlace] = (COPIED, COPIED)):
        self.key_heads, self.key_dim = key_heads, step.pool.ssm.shape[3]
        self.varlen, self.rows = varlen, rows
        self.in_place = in_place        # what `varlen` and `rows` do with the pool's rows
        self.takes_rows = False         # the chunked rules: states at chosen rows by replay (GDNStep.layer)
        step.out.at_rows = row_buffers(step)
        step.out.multi = buffers(step.pool, step.multi.layout.seqs) if step.multi is not None else None
        step.out.single = buffers(step.pool, step.single.layout.seqs) if step.single is not None else None

    def __call__(self, step: GDNStep, layer: int, u: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                 out: Tensor) -> None:
        i, c = layer, step.corrections
        conv_pool, ssm_pool = step.pool.conv.rows[:, i], step.pool.ssm.rows[:, i]
        if step.multi is not None:
            extra = (c.extra_u[i], c.extra_g[i], c.extra_beta[i]) if c is not None and c.extra_u is not None else None
            maps = (c.p[:, i], c.s_ref[:, i]) if c is not None else None
            step.out.multi.store(i, *self.varlen(u, g, beta, extra, conv_weight, conv_pool, ssm_pool,
                                                 step.multi.layout, self.key_heads, self.key_dim, out, maps))
        if step.single is not None:
            s, multi = step.single, step.out.multi
            seeds = (multi.tails[:, i], multi.corrected[:, i]) if c is not None else (None, None)
            new_hist, state, kv = self.rows(u, g, beta, conv_weight, conv_pool, ssm_pool, s.layout, self.key_heads,
                                            self.key_dim, out, seeds, factors=s.factors)
            step.out.single.store(i, state, None, new_hist, None, None)
            if kv is not None:
                step.keep_factors(u, g, beta, *kv)
        step.after_layer(u, g, beta)
