"""Gated DeltaNet state store: per slot and GDN layer, the short-conv history and the recurrent state.

The recurrent state is fp32 whatever the model dtype (transformers does the same; the deferred-prefill
state map needs it). The conv history holds the last `kernel - 1` pre-convolution inputs.

Each slot of the engine's live pool has two rows, used in turn: a step's kernels read a slot's current
row and write its new state straight into the other one (`StateRows`, by row index), and the step's
update commits by flipping which row is current (`commit`). So a step moves each state once in and once
out, nothing is copied back, and a step that fails leaves every current row as it was (the failed-step
re-run of engine/step.py relies on it). The prefix cache's checkpoint slab has one row per slot: nothing
runs on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import GDNSlotsExhaustedError


class SlotStates:
    """One kind of state (conv histories or recurrent states) of every slot. `[slot]` is the slot's current
    row (a view): what everything outside a step's kernels reads and writes. `rows` holds every row,
    `[slots * rows_per_slot, layers, ...]`, which a step's kernels index directly (`StateRows`)."""

    def __init__(self, rows: torch.Tensor, current: list[int]):
        self.rows = rows
        self._current = current     # the pool's, shared by both kinds: a commit flips both

    def __getitem__(self, slot: int) -> torch.Tensor:
        return self.rows[self._current[slot]]

    def __setitem__(self, slot: int, value: torch.Tensor) -> None:
        self.rows[self._current[slot]] = value

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot's row, every layer (from the shape: no view is made)."""
        return self.rows.element_size() * math.prod(self.rows.shape[1:])

    @property
    def shape(self) -> torch.Size:
        """`[slots, layers, ...]`: as if each slot had one row."""
        return torch.Size((len(self._current), *self.rows.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def device(self) -> torch.device:
        return self.rows.device


@dataclass(frozen=True)
class StateRows:
    """Where a step's sequences read and write their states: the current (`read`) and the other
    (`write`) row of each slot, as row indices of `SlotStates.rows`."""

    read: list[int]
    write: list[int]


class GDNStatePool:
    def __init__(
        self, num_slots: int, num_layers: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int,
        dtype: torch.dtype, device: torch.device | str, rows_per_slot: int = 2,
    ):
        if rows_per_slot not in (1, 2):
            raise ValueError("a slot has one row (a store nothing runs on) or two (used in turn)")
        self.rows_per_slot = rows_per_slot
        rows = num_slots * rows_per_slot
        current = list(range(0, rows, rows_per_slot))
        self.conv = SlotStates(torch.zeros(rows, num_layers, kernel - 1, conv_dim, dtype=dtype, device=device),
                               current)
        self.ssm = SlotStates(torch.zeros(rows, num_layers, heads, dk, dv, dtype=torch.float32, device=device),
                              current)
        self._current = current
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state (one row of each kind, every layer)."""
        return self.conv.slot_nbytes + self.ssm.slot_nbytes

    def allocate(self) -> int:
        if not self._free:
            raise GDNSlotsExhaustedError("every GDN state slot is taken (each open session holds one)", needed=1,
                                         available=0)
        slot = self._free.pop()
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst].copy_(self.conv[src])
        self.ssm[dst].copy_(self.ssm[src])

    def rows(self, slots: Iterable[int]) -> StateRows:
        """The rows a step reads `slots`' states from and writes their new states to."""
        if self.rows_per_slot != 2:
            raise ValueError("this store has one row per slot: no step writes into it")
        read = [self._current[s] for s in slots]
        return StateRows(read, [r ^ 1 for r in read])    # a slot's rows are 2s and 2s + 1

    def commit(self, slots: Iterable[int]) -> None:
        """The new states a step wrote into `slots`' other rows become current (each slot once)."""
        for s in set(slots):
            self._current[s] ^= 1
