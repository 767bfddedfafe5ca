"""Bytes of Gated DeltaNet state a step moves, against the bytes it must move, by construction from the
step's layouts (ops/gdn_layout.py) and the data path of the op that ran it (ops/gdn_step.py).

What a step must move: each sequence's state (conv history and recurrent state, every layer) read once
and each new state written once (a split sequence writes two: the new prefix state and `S_lead'`); a
join reads the live state, its map `P` and reference `S_lead` once and writes the corrected state once.
What it moves: the kernels' reads and writes of those, plus every copy made around them: on a data path
that does not take pool rows (`GDNLayerOp.in_place`), the states gathered out of the pool before the
kernel and the new states placed into it after (each a read and a write), and whatever the step's update
copies (`copies`: a join's corrected state where no decode row wrote it, the join's records). At
Qwen3.5-9B shapes a sequence's state is ~48 MiB: at batched decode these bytes set the step's speed.

`copied` is the part made of torch copies touching the pool or the update's copies: what a measurement
at the dispatcher sees (tests/ops/test_gdn_traffic.py, bench/gdn_traffic.py); the kernels' own reads
and writes are not torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from ..cache.gdn_state import GDNStatePool
    from .gdn_step import GDNStep


@dataclass(frozen=True)
class GDNTraffic:
    """Bytes of GDN state one step (or several, added) moves."""

    required: int       # each state read once, each new state written once
    moved: int          # what the step's data path reads and writes, copies included
    copied: int         # of `moved`: copies by torch ops into or out of the pool, and the update's copies

    @property
    def ratio(self) -> float:
        """moved / required (1.0 for a step without GDN state)."""
        return self.moved / self.required if self.required else 1.0

    def __add__(self, other: GDNTraffic) -> GDNTraffic:
        return GDNTraffic(self.required + other.required, self.moved + other.moved, self.copied + other.copied)



def step_traffic(step: GDNStep, copies: int = 0) -> GDNTraffic:
    """The traffic of `step`, prepared by its op set (`step.op`), whose update copies `copies` bytes of
    state besides (engine/runner.py counts them)."""
    pool = step.pool
    state, hist = pool.ssm.slot_nbytes, pool.conv.slot_nbytes     # one slot's, every layer
    slot = state + hist
    layers, heads, dk = pool.ssm.shape[1:4]
    map_bytes = layers * heads * dk * dk * 4    # a join's P, fp32
    required = moved = copied = 0
    groups = ((step.multi, step.op.in_place[0]), (step.single, step.op.in_place[1]))
    for group, in_place in groups:
        if group is None:
            continue
        seqs = group.layout.seqs
        reads, writes = seqs.count * slot, (seqs.count + seqs.splits) * slot
        joins = seqs.joins * (3 * state + map_bytes)     # live state, P and S_lead read; corrected written
        required += reads + writes + joins
        moved += reads + writes + joins
        # what is gathered out of the pool (the joins' live states too) and placed into it by copies
        each = (0 if in_place.conv else hist) + (0 if in_place.state else state)
        # the sequences and splits whose states go into the pool, not the step's buffers
        placed = 0 if seqs.out_row is None else seqs.count - seqs.buffered + seqs.splits - seqs.split_buffered
        extra = 2 * (each * (seqs.count + placed) + (0 if in_place.state else seqs.joins * state))
        moved += extra
        copied += extra
    if step.at_rows is not None:    # the states at chosen rows, each written once
        captures = step.at_rows.captures
        required += captures.rows.shape[0] * slot
        moved += captures.rows.shape[0] * slot
        if not step.op.takes_rows:  # replayed: the first round gathers its sequences' states out of the pool
            gathered = 2 * captures.rounds[0].seqs.count * slot
            moved += gathered
            copied += gathered
    return GDNTraffic(required, moved + copies, copied + copies)


class StateCopies(TorchDispatchMode):
    """The measurement `GDNTraffic.copied` is checked against: while active, the bytes torch ops copy out
    of or into `pool` (an op that reads its storage into a tensor of its own, or writes it; each byte read
    and written counts, as in `GDNTraffic`), and the bytes of state-shaped tensors they allocate (outputs
    ending in a slot's recurrent-state or conv-history shape). Views and the native kernels (not torch
    ops) are not seen. A state-shaped tensor has rows: `[rows, (layers,) H, Dk, Dv]` or `[rows, (layers,)
    K-1, C]`."""

    supports_higher_order_operators = True      # FlexAttention passes through, run as it is

    def __init__(self, pool: GDNStatePool):
        super().__init__()
        self.storages = {pool.conv.rows.untyped_storage().data_ptr(), pool.ssm.rows.untyped_storage().data_ptr()}
        self.shapes = (tuple(pool.ssm.shape[2:]), tuple(pool.conv.shape[2:]))
        self.copied = 0
        self.allocated = 0

    def _in_pool(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_mkldnn \
            and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", True):      # aten ops; higher-order ones (FlexAttention) have no flag
            in_place = torch.Tag.inplace in func.tags
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            if in_place and tensors and self._in_pool(tensors[0]):      # written into the pool
                self.copied += 2 * sum(t.nbytes for t in tensors[1:] if t.is_floating_point())
            elif any(self._in_pool(t) for t in tensors):                # read out of it
                self.copied += 2 * sum(t.nbytes for t in outs if not self._in_pool(t))
            if not in_place:
                self.allocated += sum(t.nbytes for t in outs if not self._in_pool(t) and any(
                    t.dim() > len(s) and tuple(t.shape[-len(s):]) == s for s in self.shapes))
        return out
