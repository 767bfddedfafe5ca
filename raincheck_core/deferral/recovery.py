"""One turn's deferred input D: what is still to prefill, in source order, and the state it needs.

D is prefilled in chunks fused with the turn's decode steps (raincheck, after the guard), then after
the answer in larger prefill-only chunks, until none is left; the session's next turn waits for that
(the completion barrier).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .gdn_join import GDNJoin, JoinSnapshot
from .policy import DeferralConfig

if TYPE_CHECKING:
    from ..multimodal.turn_input import TurnInput
    from ..ops.backend import GDNOps


_serials = itertools.count(1)


@dataclass(frozen=True)
class RecoverySnapshot:
    """A recovery as it was when a later turn was admitted without waiting for it: a failed follow-up
    puts it back so (its rows are never dropped by someone else's failure)."""

    recovery: Recovery
    cursor: int
    chunks: int
    failures: int
    join: JoinSnapshot | None


class Recovery:
    def __init__(self, rows: TurnInput, cfg: DeferralConfig, join: GDNJoin | None, turn: int = 0,
                 serial: int | None = None):
        self.rows = rows
        self.turn = turn               # the session's turn index: names this recovery (hand-off tickets)
        # unique in its engine: a result made for an undone attempt of the same turn is refused (the engine
        # numbers its own, so that the replicas of an engine's ranks number theirs alike)
        self.serial = next(_serials) if serial is None else serial
        self.cfg = cfg
        self.join = join
        self.cursor = 0
        self.slots: list[torch.Tensor] = []   # KV slots each processed chunk wrote, in order (pages to ship)
        self.answer_done = False
        # Hand-off (engine/residual.py): `held` while a deferred worker may deliver the rows from the cursor
        # on. Then post-answer gap recovery leaves them alone, and fused chunks run only if `fuse_held`;
        # `racing` once a barrier waits for them: local recovery runs too, and whichever ends first wins.
        self.held = False
        self.fuse_held = True
        self.racing = False
        self.t_answer_end: float | None = None
        self.t_done: float | None = None
        self.failures = 0              # steps that failed on this recovery's own rows

    @property
    def total(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> int:
        return self.total - self.cursor

    @property
    def done(self) -> bool:
        return self.cursor >= self.total

    @property
    def handed_off(self) -> bool:
        """Local gap recovery leaves this recovery to a deferred worker."""
        return self.held and not self.racing

    def past_guard(self, fed: int) -> bool:
        """Deferred rows may join the turn's cache while its answer streams, `fed` answer tokens in: the
        policy fuses and the guard is behind (the one guard rule: fused chunks and a hand-off's result)."""
        return self.cfg.fuses and fed >= self.cfg.guard

    def fuses_now(self, fed: int) -> bool:
        """A chunk may ride on a decode step: past the guard, rows left (and, while held for a deferred
        worker, fusing allowed)."""
        return not self.answer_done and self.past_guard(fed) and not self.done and (self.fuse_held or not self.held)

    def hold(self, fuse: bool) -> None:
        """Reserve the rows from the cursor on for a deferred worker; fused chunks still run with `fuse`."""
        self.held, self.fuse_held = True, fuse

    def take_back(self) -> None:
        """The deferred worker failed or timed out: local recovery runs the rest."""
        self.held = self.racing = False

    def race(self) -> None:
        """A barrier waits for this held recovery: recover it locally too; a result that comes first still
        joins."""
        self.racing = True

    def give_up(self) -> None:
        """Drop the rows not restored yet (the session goes on as if they had been pruned)."""
        self.cursor = self.total

    def mark_answer_done(self, now: float) -> None:
        self.answer_done = True
        self.t_answer_end = now

    def advance(self, n: int, now: float) -> None:
        """`n` more rows are in (`now`: the engine's clock)."""
        self.cursor += n
        if self.done:
            self.t_done = now

    @property
    def completion_s(self) -> float | None:
        """Time from the answer's end to the last deferred row (0 if D was done before the answer)."""
        if self.t_done is None:
            return None
        return max(0.0, self.t_done - (self.t_answer_end or self.t_done))

    def snapshot(self, gdn_ops: GDNOps) -> RecoverySnapshot:
        """`gdn_ops`: what folds the join's buffered factors into the map it keeps."""
        return RecoverySnapshot(self, self.cursor, len(self.slots), self.failures,
                                self.join.snapshot(gdn_ops) if self.join is not None else None)

    def restore(self, snap: RecoverySnapshot) -> None:
        """Back to `snap` (rows restored since are undone with the slots they were written to)."""
        self.cursor, self.failures, self.t_done = snap.cursor, snap.failures, None
        del self.slots[snap.chunks:]
        if self.join is not None:
            self.join.restore(snap.join)

    def release(self) -> None:
        if self.join is not None:
            self.join.release()
