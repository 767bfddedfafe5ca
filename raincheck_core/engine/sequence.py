"""A session's cache: its KV page table, its GDN state slot, and where its token stream stands."""

from __future__ import annotations

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PageTable
from ..layers.batch import Segment, causal_mask


class Sequence:
    def __init__(self, kv: KVPool, gdn: GDNStatePool | None, max_pages: int):
        self.table = PageTable(kv, max_pages)
        self.gdn = gdn
        self.gdn_slot = gdn.allocate() if gdn is not None else None
        self.next_position = 0            # position id of the next token (text or generated)
        self.pending_ids: list[int] = []  # sampled by the last turn but never fed (its stop token)
        self.tokens: list[int] = []       # every token fed so far, in processing order

    @property
    def length(self) -> int:
        return self.table.length

    def add_rows(self, start_row: int, n: int) -> Segment:
        """Claim slots for `n` new rows that see the whole sequence so far and themselves causally."""
        past = self.table.length
        write = self.table.append(n)
        if past == 0:
            read, mask = None, None
        else:
            read = self.table.readable(0, past + n)
            mask = causal_mask(past, n, write.device) if n > 1 else None
        return Segment(start_row, start_row + n, write, read, mask, self.gdn_slot)

    def release(self) -> None:
        self.table.release()
        if self.gdn is not None and self.gdn_slot is not None:
            self.gdn.release(self.gdn_slot)
            self.gdn_slot = None
