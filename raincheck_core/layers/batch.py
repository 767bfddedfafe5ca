"""What one forward pass reads: the packed rows of a step and, per mixer kind, where they go.

The model runner builds a `ForwardBatch` from the step's plan (engine/runner.py); the layers read it
and never see sessions. Attention layers share one `AttentionLayout`; GDN layers share one `GDNStep`,
which splits the step's sequences into two groups (one call each on the torch path):
- `multi`: sequences of several rows (prefill and deferred chunks), with the deferred joins;
- `single`: one-row sequences (decode rows), *after* `multi`, because a decode row may start from a
  state that `multi` just corrected (see `GDNCorrections`).
New states are not written back by the layers: they are collected in `GDNOutputs` (buffers that hold every
layer's rows, `[rows, layers, ...]`) and applied by the engine's update, so a forward that fails half-way
leaves every state as it was. On the CPU in fp32 the step has one `GDNKernel` prepared once (ops/gdn_kernel.py)
that runs both groups, the joins between them: a layer's call then passes only its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..ops.attention import AttentionLayout
from ..ops.gdn_kernel import GDNBuffers, GDNKernel
from ..ops.gdn_varlen import VarlenLayout


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
    keep: torch.Tensor | None        # [T] positions whose factors (u, k, v, g, beta) the update needs


@dataclass
class GDNOutputs:
    """The step's new GDN states, every layer's rows side by side, and the one-row sequences' factors."""

    multi: GDNBuffers | None = None         # finals, tails, split states and tails, corrected live states
    single: GDNBuffers | None = None        # finals, tails
    x: torch.Tensor | None = None           # [layers, R, C] step rows' [q | k | v] (native, tracked rows)
    # per layer: u, k, v, g, beta of the one-row sequences
    factors: list[tuple[torch.Tensor, ...]] = field(default_factory=list)


@dataclass
class GDNStep:
    pool: GDNStatePool
    multi: GDNMulti | None = None
    corrections: GDNCorrections | None = None
    single: GDNSingle | None = None
    out: GDNOutputs = field(default_factory=GDNOutputs)
    # the native path: both groups in one call per layer, the joins between them (their outputs are
    # `out.multi` and `out.single`, views of one buffer); None: the torch ops, group by group
    kernel: GDNKernel | None = None


@dataclass
class ForwardBatch:
    embeds: torch.Tensor                     # [R, hidden]
    positions: torch.Tensor                  # [3, R]
    kv: KVPool | None
    attention: AttentionLayout | None
    gdn: GDNStep | None
    logit_rows: torch.Tensor | None = None   # rows whose logits are needed; None = all
    deepstack_rows: torch.Tensor | None = None          # visual rows that receive DeepStack features
    deepstack: list[torch.Tensor] = field(default_factory=list)   # per level, [len(deepstack_rows), hidden]
    cos: torch.Tensor | None = None          # filled by the model once per step
    sin: torch.Tensor | None = None
