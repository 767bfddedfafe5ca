"""A session's cache: its KV page table, its GDN state slot, and where its token stream stands."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PageTable
from ..deferral.recovery import Recovery
from ..deferral.visibility import deferred_mask
from ..layers.batch import Segment, causal_mask


class Sequence:
    def __init__(self, kv: KVPool, gdn: GDNStatePool | None, max_pages: int):
        self.table = PageTable(kv, max_pages)
        self.gdn = gdn
        self.gdn_slot = gdn.allocate() if gdn is not None else None
        self.next_position = 0            # position id of the next token (text or generated)
        self.pending_ids: list[int] = []  # sampled by the last turn but never fed (its stop token)
        self.tokens: list[int] = []       # every token fed so far, in processing order
        self.recovery: Recovery | None = None   # the latest turn's deferred input, while any is left
        self.last_recovery_s: float | None = None   # post-answer completion time of the last recovery
        self._generated = torch.zeros(0, dtype=torch.bool)   # per slot: GEN of the recovering turn

    @property
    def length(self) -> int:
        return self.table.length

    def add_rows(self, start_row: int, n: int, *, generated: bool = False,
                 gdn_hook: Callable[..., None] | None = None) -> Segment:
        """Claim slots for `n` new rows that see the whole sequence so far and themselves causally.
        `generated` labels them GEN: invisible to this turn's deferred rows."""
        past = self.table.length
        write = self.table.append(n)
        self._label(past, n, generated)
        if past == 0:
            read, mask = None, None
        else:
            read = self.table.readable(0, past + n)
            mask = causal_mask(past, n, write.device) if n > 1 else None
        return Segment(start_row, start_row + n, write, read, mask, self.gdn_slot, gdn_hook)

    def add_deferred_rows(self, start_row: int, n: int, gdn_slot: int | None,
                          gdn_hook: Callable[..., None] | None) -> Segment:
        """Slots for `n` deferred rows: they see everything but GEN, and run on the prefix GDN path."""
        past = self.table.length
        write = self.table.append(n)
        mask = deferred_mask(self._generated[:past], n)
        self._label(past, n, False)
        return Segment(start_row, start_row + n, write, self.table.readable(0, past + n), mask, gdn_slot, gdn_hook)

    def clear_generated(self) -> None:
        """The turn's recovery is complete: from now on every slot is plain context."""
        self._generated.zero_()

    def _label(self, start: int, n: int, generated: bool) -> None:
        if self._generated.shape[0] < start + n:
            grown = torch.zeros(max(2 * self._generated.shape[0], start + n, 64), dtype=torch.bool)
            grown[: self._generated.shape[0]] = self._generated
            self._generated = grown
        self._generated[start:start + n] = generated

    def release(self) -> None:
        if self.recovery is not None:
            self.recovery.release()
            self.recovery = None
        self.table.release()
        if self.gdn is not None and self.gdn_slot is not None:
            self.gdn.release(self.gdn_slot)
            self.gdn_slot = None
