"""A session's cache: its KV page table, its GDN state slot, and where its token stream stands.

Slots are claimed when a step is planned (`claim`) and filled when the step's results are applied
(`fill`, which also records the tokens fed and where positions stand): a step that fails never changed
the cache. A turn keeps a `Checkpoint` of the cache from its admission, so a turn that fails can be
undone whole (`restore`). The cache owns its turn's recovery (`recovery`): nothing else holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PageTable
from ..deferral.recovery import Recovery
from ..deferral.visibility import deferred_visible


@dataclass
class Checkpoint:
    turns: int
    length: int
    next_position: int
    tokens: int
    pending_ids: list[int]
    conv: torch.Tensor | None
    ssm: torch.Tensor | None


class SessionCache:
    def __init__(self, session: str, kv: KVPool, gdn: GDNStatePool | None, max_pages: int):
        self.session = session            # the id plans name this cache by
        self.table = PageTable(kv, max_pages)
        self.gdn = gdn
        self.gdn_slot = gdn.allocate() if gdn is not None else None
        self.turns = 0                    # turns admitted (and not undone)
        self.next_position = 0            # position id of the next token (text or generated)
        self.pending_ids: list[int] = []  # sampled by the last turn but never fed (its stop token)
        self.tokens: list[int] = []       # every token fed so far, in processing order
        self.recovery: Recovery | None = None   # the latest turn's deferred input, while any is left
        self.last_recovery_s: float | None = None   # post-answer completion time of the last recovery
        self.deterministic = False        # the latest turn's steps run apart from other sessions' rows
        self._generated = torch.zeros(0, dtype=torch.bool)   # per slot: GEN of the recovering turn
        self._claimed = 0                 # slots claimed by the step being planned

    @property
    def length(self) -> int:
        """Slots filled (what the cache holds)."""
        return self.table.length

    # ---------------------------------------------------------------- planning a step
    def claim(self, n: int) -> torch.Tensor:
        """The next `n` slots after those already claimed for this step."""
        slots = self.table.ahead(self._claimed, n)
        self._claimed += n
        return slots

    def readable(self, n: int, *, hide_generated: bool = False) -> torch.Tensor:
        """Slots the `n` rows claimed last may read, their own last: every slot before them (filled, or
        claimed earlier in this step), or only the non-GEN ones (deferred rows)."""
        filled = self.table.length
        ids = self.table.reserved_slots(0, filled + self._claimed)
        if not hide_generated or not filled:
            return ids
        # slots claimed earlier in this step before these rows are earlier chunks: visible
        return torch.cat([ids[deferred_visible(self._generated[:filled])], ids[filled:]])

    def cancel_claims(self) -> None:
        self._claimed = 0

    # ---------------------------------------------------------------- applying a step
    def fill(self, n: int, *, generated: bool = False, tokens: list[int] | None = None,
             next_position: int | None = None) -> None:
        """The first `n` claimed slots now hold K/V; `generated` labels them GEN (invisible to this
        turn's deferred rows). `tokens`: the ids fed in them (a turn's input or answer rows; deferred rows
        are not part of the token stream), `next_position`: the position id of the next token after them."""
        if tokens:
            self.tokens.extend(tokens)
        if next_position is not None:
            self.next_position = next_position
        start = self.table.length
        self.table.advance(n)
        self._claimed = max(0, self._claimed - n)
        if self._generated.shape[0] < start + n:
            grown = torch.zeros(max(2 * self._generated.shape[0], start + n, 64), dtype=torch.bool)
            grown[: self._generated.shape[0]] = self._generated
            self._generated = grown
        self._generated[start:start + n] = generated

    def generated_slots(self) -> torch.Tensor:
        """Slot ids of the GEN slots (the recovering turn's fed answer tokens)."""
        pos = self._generated[: self.length].nonzero().flatten()
        return self.table.slots(0, self.length)[pos] if len(pos) else torch.empty(0, dtype=torch.long)

    def visible_slots(self) -> torch.Tensor:
        """Slot ids of every non-GEN slot, in order: what deferred rows may read."""
        return self.table.slots(0, self.length)[deferred_visible(self._generated[: self.length])]

    def end_recovery(self) -> None:
        """The recovery is complete (or given up): its prefix state is released and, from now on, every
        slot is plain context."""
        rec = self.recovery
        rec.release()
        self._generated.zero_()
        self.last_recovery_s = rec.completion_s
        self.recovery = None

    # ---------------------------------------------------------------- undoing a turn
    def checkpoint(self) -> Checkpoint:
        conv = ssm = None
        if self.gdn is not None:
            conv, ssm = self.gdn.conv[self.gdn_slot].clone(), self.gdn.ssm[self.gdn_slot].clone()
        return Checkpoint(self.turns, self.length, self.next_position, len(self.tokens), list(self.pending_ids),
                          conv, ssm)

    def restore(self, cp: Checkpoint) -> None:
        """Back to `cp`: later slots and pages released, the recurrent state as it was, no recovery."""
        self._claimed = 0
        if self.recovery is not None:
            self.recovery.release()
            self.recovery = None
        self._generated[cp.length:] = False
        self.table.truncate(cp.length)
        self.turns = cp.turns
        self.next_position = cp.next_position
        del self.tokens[cp.tokens:]
        self.pending_ids = list(cp.pending_ids)
        if self.gdn is not None:
            self.gdn.conv[self.gdn_slot].copy_(cp.conv)
            self.gdn.ssm[self.gdn_slot].copy_(cp.ssm)

    def release(self) -> None:
        if self.recovery is not None:
            self.recovery.release()
            self.recovery = None
        self.table.release()
        if self.gdn is not None and self.gdn_slot is not None:
            self.gdn.release(self.gdn_slot)
            self.gdn_slot = None
