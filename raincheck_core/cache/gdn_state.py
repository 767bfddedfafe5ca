"""Gated DeltaNet state store: per slot and GDN layer, the short-conv history and the recurrent state.

The recurrent state is fp32 whatever the model dtype (transformers does the same; the deferred-prefill
state map needs it). The conv history holds the last `kernel - 1` pre-convolution inputs.
"""

from __future__ import annotations

import torch

from ..errors import GDNSlotsExhaustedError


class GDNStatePool:
    def __init__(
        self, num_slots: int, num_layers: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int,
        dtype: torch.dtype, device: torch.device | str,
    ):
        self.conv = torch.zeros(num_slots, num_layers, kernel - 1, conv_dim, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_slots, num_layers, heads, dk, dv, dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

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
