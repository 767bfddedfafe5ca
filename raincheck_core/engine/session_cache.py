"""A session's cache: its KV page table, its GDN state slot, and where its token stream stands.

Slots are claimed when a step is planned (`claim`) and filled when the step's results are applied
(`fill`, which also records the tokens fed and where positions stand): a step that fails never changed
the cache. A turn keeps a `Checkpoint` of the cache from its admission, so a turn that fails can be
undone whole (`restore`). The cache owns its recoveries: `recovery`, the one being restored, and,
after a follow-up that did not wait for it (a bounded barrier, docs/mechanism.md §10), `queued`, the
follow-up's own, restored once the first is complete. Nothing else holds them.

Every slot is labelled when claimed with the turn that wrote it and whether it is a generated token:
what a deferred row may read follows from these labels (deferral/visibility.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool, PageTable
from ..cache.prefix import Hit, PrefixChain
from ..deferral.recovery import Recovery, RecoverySnapshot
from ..deferral.visibility import visible_to

if TYPE_CHECKING:
    from ..ops.backend import GDNOps


@dataclass
class Checkpoint:
    turns: int
    length: int
    next_position: int
    tokens: int
    pending_ids: list[int]
    conv: torch.Tensor | None
    ssm: torch.Tensor | None
    late: RecoverySnapshot | None = None     # a previous turn's recovery still pending at admission


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
        self.recovery: Recovery | None = None   # deferred input being restored, while any is left
        self.queued: Recovery | None = None     # the next turn's, while `recovery` is a previous turn's
        self.last_recovery_s: float | None = None   # post-answer completion time of the last recovery
        # per slot: the turn that wrote it, and whether it is a token that turn generated; numpy, since a
        # decode step labels one slot per session and a numpy write costs a tenth of a tensor's on the host
        self._turn_of = np.zeros(0, dtype=np.int32)
        self._generated = np.zeros(0, dtype=np.bool_)
        self.deterministic = False        # the latest turn's steps run apart from other sessions' rows
        self._claimed = 0                 # slots claimed by the step being planned
        self.chain = PrefixChain(kv.page_size)   # what its slots hold, for the prefix cache
        self.published = 0                # full pages of the chain handed to the prefix cache
        # GDN states (conv, ssm) after the chain's first k pages, by k, taken inside this step's prefills:
        # handed to the prefix cache with the pages (engine/core.py)
        self.gdn_checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Slots filled (what the cache holds)."""
        return self.table.length

    @property
    def latest_turn(self) -> int:
        """The index of the latest admitted turn (the one whose rows a running turn writes)."""
        return self.turns - 1

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of scheduling metadata: the slot labels and the pending recoveries' lists of written slots."""
        return self._turn_of.nbytes + self._generated.nbytes + sum(t.nbytes for r in self.recoveries() for t in r.slots)

    def recoveries(self) -> list[Recovery]:
        """The pending recoveries, oldest first."""
        return [r for r in (self.recovery, self.queued) if r is not None]

    def own_recovery(self, turn: int) -> Recovery | None:
        """Turn `turn`'s own recovery, if it is pending."""
        return next((r for r in self.recoveries() if r.turn == turn), None)

    def may_go_late(self, input_rows: int) -> bool:
        """Whether a follow-up with `input_rows` input rows may be admitted with this cache's recovery still
        pending (a bounded barrier, docs/mechanism.md §10): at most two turns' rows pending at once (the
        previous turn's, the follow-up's own), the previous answer is over, and for GDN models the rows
        fed after its insertion boundary, with the follow-up's input, cover the conv lead (so the join's
        lead is complete before its next chunk, and later boundaries lie past it)."""
        rec = self.recovery
        if rec is None or self.queued is not None or not rec.answer_done:
            return False
        return rec.join is None or rec.join.fed + input_rows >= rec.join.lead

    # ---------------------------------------------------------------- planning a step
    def claim(self, n: int, turn: int | None = None, generated: bool = False) -> torch.Tensor:
        """The next `n` slots after those already claimed for this step, labelled as written by `turn`
        (default: the latest turn) and, with `generated`, as its generated tokens."""
        start = self.table.length + self._claimed
        slots = self.table.ahead(self._claimed, n)
        self._claimed += n
        if self._turn_of.shape[0] < start + n:
            size = max(2 * self._turn_of.shape[0], start + n, 64)
            self._turn_of = _grown(self._turn_of, size)
            self._generated = _grown(self._generated, size)
        label = self.latest_turn if turn is None else turn
        if n == 1:      # a decode row's: a numpy element write costs a fifth of a slice write
            self._turn_of[start], self._generated[start] = label, generated
        else:
            self._turn_of[start:start + n], self._generated[start:start + n] = label, generated
        return slots

    def readable(self, n: int) -> torch.Tensor:
        """Slots the `n` rows claimed last may read, their own last: every slot before them (filled, or
        claimed earlier in this step)."""
        return self.table.reserved_slots(0, self.table.length + self._claimed)

    @property
    def pages(self) -> np.ndarray:
        """The page ids (int64) of `readable`'s lists: the reserved pages, of which a list of k slots spans the
        first ceil(k / page size). Read it after the claims: a claim may reserve a page."""
        return self.table.page_ids

    def deferred_readable(self, n: int, turn: int) -> tuple[torch.Tensor, np.ndarray]:
        """For the `n` deferred rows of turn `turn` claimed last: the slots their labels let them read
        (deferral/visibility.py), their own last, and the positions among the session's slots up to
        theirs that this leaves out (FlexAttention reads the pages from those: ops/flex_runs.py)."""
        end = self.table.length + self._claimed
        seen = self._visible(end, turn)
        # numpy's boolean index: torch's on a mask is 3-4x slower (a chunk a step per session, 4K-slot lists)
        return torch.from_numpy(self.table.reserved_slots(0, end).numpy()[seen]), np.flatnonzero(~seen)

    def cancel_claims(self) -> None:
        self._claimed = 0

    # ---------------------------------------------------------------- applying a step
    def fill(self, n: int, *, tokens: list[int] | None = None, next_position: int | None = None,
             keys: torch.Tensor | np.ndarray | None = None) -> int:
        """The first `n` claimed slots now hold K/V. `tokens`: the ids fed in them (a turn's input or
        answer rows; deferred rows are not part of the token stream), `next_position`: the position id of
        the next token after them, `keys`: what the rows are, when each saw every slot before it and every
        later row will see them (cache/prefix.py; None ends the prefix chain). Returns how many pages of
        the prefix chain this completed."""
        pages = self.chain.extend(self.table.length, keys)
        if tokens:
            self.tokens.extend(tokens)
        if next_position is not None:
            self.next_position = next_position
        self.table.advance(n)
        self._claimed = max(0, self._claimed - n)
        return pages

    def keep_checkpoints(self, slots: list[int], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The GDN states after slots `slots` (page boundaries; conv `[m, layers, K-1, C]`, ssm `[m, layers, H,
        Dk, Dv]`), kept for the prefix cache where the chain describes every page before them."""
        page = self.chain.page_size
        for slot, c, s in zip(slots, conv, ssm, strict=True):
            if slot // page <= len(self.chain.hashes):
                self.gdn_checkpoints[slot // page] = (c, s)

    def adopt(self, hit: Hit, keys: torch.Tensor, tokens: list[int]) -> None:
        """An empty cache starts on the prefix cache's `hit`: its pages, the rows `keys` describes (the
        token ids `tokens`), the GDN state after them."""
        self.table.adopt(hit.pages, len(keys))
        self.chain.adopt(hit, keys)
        self.published = len(hit.pages)
        self.tokens.extend(tokens)
        if self.gdn is not None:
            conv, ssm = hit.state
            self.gdn.conv[self.gdn_slot].copy_(conv)
            self.gdn.ssm[self.gdn_slot].copy_(ssm)

    def fork(self, parent: SessionCache) -> None:
        """This new cache (its pages for an answer reserved) becomes a branch of `parent` after its prompt: the
        prompt's pages shared, the GDN state copied, the same token stream and positions. The parent has
        no recovery (an `n > 1` turn defers nothing: docs/mechanism.md §12)."""
        self.table.fork(parent.table)
        self.chain = copy.deepcopy(parent.chain)
        self.published = parent.published
        self.tokens = list(parent.tokens)
        self.next_position = parent.next_position
        self.turns = parent.turns
        self._turn_of, self._generated = parent._turn_of.copy(), parent._generated.copy()
        self.deterministic = parent.deterministic
        if self.gdn is not None:
            self.gdn.conv[self.gdn_slot].copy_(self.gdn.conv[parent.gdn_slot])
            self.gdn.ssm[self.gdn_slot].copy_(self.gdn.ssm[parent.gdn_slot])

    def generated_slots(self) -> torch.Tensor:
        """Slot ids of the filled slots the pending recovery's rows may not read (none without one)."""
        if self.recovery is None:
            return torch.empty(0, dtype=torch.long)
        n = self.length
        return self.table.slots(0, n)[torch.from_numpy(~self._visible(n, self.recovery.turn))]

    def visible_slots(self) -> torch.Tensor:
        """Slot ids of the filled slots the pending recovery's rows may read, in order."""
        n = self.length
        return self.table.slots(0, n)[torch.from_numpy(self._visible(n, self.recovery.turn))]

    def _visible(self, end: int, turn: int) -> np.ndarray:
        """Per slot of the first `end`: may deferred rows of `turn` read it (deferral/visibility.py)."""
        return visible_to(self._turn_of[:end], self._generated[:end], turn)

    def end_recovery(self) -> None:
        """The recovery is complete (or given up): its prefix state is released; the queued recovery of
        a later turn, if any, is restored next."""
        rec = self.recovery
        rec.release()
        self.last_recovery_s = rec.completion_s
        self.recovery, self.queued = self.queued, None
        if self.recovery is not None and self.recovery.join is not None:
            self.recovery.join.behind = None      # nothing ahead of it any more to rebase it

    # ---------------------------------------------------------------- undoing a turn
    def checkpoint(self, gdn_ops: GDNOps) -> Checkpoint:
        """The cache as it is now (`gdn_ops`: what folds a pending GDN join's buffered factors first)."""
        conv = ssm = None
        if self.gdn is not None:
            conv, ssm = self.gdn.conv[self.gdn_slot].clone(), self.gdn.ssm[self.gdn_slot].clone()
        late = self.recovery.snapshot(gdn_ops) if self.recovery is not None else None
        return Checkpoint(self.turns, self.length, self.next_position, len(self.tokens), list(self.pending_ids),
                          conv, ssm, late)

    def restore(self, cp: Checkpoint) -> None:
        """Back to `cp`: later slots and pages released, the recurrent state as it was; a previous turn's
        recovery pending at `cp` is pending again as it was then (rows it restored since are undone), any
        other is dropped."""
        self._claimed = 0
        kept = cp.late.recovery if cp.late is not None else None
        for rec in self.recoveries():
            if rec is not kept:
                rec.release()
        self.recovery, self.queued = kept, None
        if cp.late is not None:
            kept.restore(cp.late)
        self.table.truncate(cp.length)
        self.chain.truncate(cp.length)
        self.published = min(self.published, len(self.chain.hashes))
        self.turns = cp.turns
        self.next_position = cp.next_position
        del self.tokens[cp.tokens:]
        self.pending_ids = list(cp.pending_ids)
        if self.gdn is not None:
            self.gdn.conv[self.gdn_slot].copy_(cp.conv)
            self.gdn.ssm[self.gdn_slot].copy_(cp.ssm)

    def release(self) -> None:
        for rec in self.recoveries():
            rec.release()
        self.recovery = self.queued = None
        self.table.release()
        self.chain = PrefixChain(self.table.pool.page_size)
        self.published = 0
        if self.gdn is not None and self.gdn_slot is not None:
            self.gdn.release(self.gdn_slot)
            self.gdn_slot = None


def _grown(labels: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=labels.dtype)
    out[: labels.shape[0]] = labels
    return out
