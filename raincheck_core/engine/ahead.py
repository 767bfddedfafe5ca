"""The next decode step planned, and its inputs staged, while this step's forward runs (vLLM v1's async
scheduling, for the steps of answers: decode rows, and the deferred chunks fused into them).

On a device the forward returns once its kernels are queued, and the host waits at the first read of its
values (sampling). Before that read the update does its bookkeeping (engine/update.py: the slots filled, the
GDN slots flipped, the joins' records, the cursors moved) and then, when this step is a decode step and every
running turn goes on decoding, the engine core plans the next one as the scheduler would after this step
(each turn's next row, its slot claimed after this step's, and the deferred rows its policy fuses from the
recovery's new cursor) and the runner stages its inputs (engine/runner.py `stage`) in its other staging
buffer: everything but the tokens the decode rows feed, which this step has not drawn yet. The next step
writes them in (`Staged.retoken`), sends and launches, so the host work between two forwards is sampling,
settling and that, not planning and building inputs (docs/design.md). Under a TPOT objective the fused rows
are chosen before this step's time is charged to the turns' slack: one step later than when planned in turn,
as in vLLM's async scheduling; with fixed chunks the steps are the same.

A step staged ahead is a bet that nothing changes in between. The core drops it (its claims cancelled, as a
failed forward's are) when this step ends, fails or forks a turn or completes a recovery other than an answering
session's own with nothing queued behind it (`EngineCore.ahead_survives`), when anything but a step loop or a
reader takes the engine lock (an admission, a cancel, a close: `EngineLock`'s `on_hold`), and when the next
step finds the running or recovering sessions changed; that step is then planned as it would have been.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import Kind, StepPlan

if TYPE_CHECKING:
    from .request import TurnRequest
    from .runner import Staged
    from .session_cache import SessionCache


@dataclass
class Ahead:
    """A step planned and staged beside the previous one's forward."""

    plan: StepPlan
    staged: Staged
    turns: list[TurnRequest]        # each decode row's turn, in plan order
    recovering: list[SessionCache]  # the sessions recovering after their answer then (the scheduler's list)


@dataclass
class AheadCounts:
    """Steps staged ahead since the engine started: launched as staged, or dropped (planned again)."""

    staged: int = 0
    launched: int = 0
    dropped: int = 0


class Drawn:
    """A running turn as the scheduler finds it once this step's token is drawn (the next step planned ahead
    reads it so): one more answer row fed, which moves its fused chunks' guard. Everything else is the
    turn's own; its last token is not known yet (`Staged.retoken` writes it in)."""

    def __init__(self, turn: TurnRequest):
        self.turn_request = turn

    def __getattr__(self, name: str) -> object:
        return getattr(self.turn_request, name)

    @property
    def answer_fed(self) -> int:
        return self.turn_request.answer_fed + 1


# what a step staged ahead holds: the running turns' decode rows, the deferred chunks fused into them, and other
# sessions' post-answer chunks in the budget they leave
STAGED_KINDS = frozenset({Kind.DECODE, Kind.DEFERRED, Kind.RECOVERY})


def decode_step(plan: StepPlan) -> bool:
    """Whether `plan` is decode rows and deferred chunks alone, in one pass (what a step staged ahead is)."""
    return bool(plan.segments) and all(s.kind in STAGED_KINDS and not s.serial and s.rows for s in plan.segments)


def continues(turn: TurnRequest) -> bool:
    """Whether `turn` decodes in the next step too, as far as can be told before this step's token is drawn:
    it decodes, shares steps, and has room for two more tokens (the one drawn now and the next)."""
    return (turn.decoding and not turn.finished and not turn.cache.deterministic
            and turn.params.max_new_tokens - len(turn.generated) >= 2)
