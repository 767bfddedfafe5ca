"""The next decode step planned, and its inputs staged, while this step's forward runs (vLLM v1's async
scheduling, where it pays most: steps of decode rows alone).

On a device the forward returns once its kernels are queued, and the host waits at the first read of its
values (sampling). Before that read the update does its bookkeeping (engine/update.py) and then, when this
step is a plain decode step and nothing else is scheduled, the engine core plans the next one (each running
turn's next row, its slot claimed after this step's fill) and the runner stages its inputs
(engine/runner.py `stage`) in its other staging buffer: everything but the tokens the rows feed, which this
step has not drawn yet. The next step writes them in (`Staged.retoken`), sends and launches, so the host work
between two forwards is sampling, settling and that, not planning and building inputs (docs/design.md).

A step staged ahead is a bet that nothing changes in between. The core drops it (its claims cancelled, as a
failed forward's are) when this step ends, fails or forks a turn or completes a recovery, when anything but a
step loop takes the engine lock (an admission, a cancel, a close: `EngineLock`'s `on_hold`), and when the next
step finds the running turns changed; that step is then planned as it would have been.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import Kind, StepPlan

if TYPE_CHECKING:
    from .request import TurnRequest
    from .runner import Staged


@dataclass
class Ahead:
    """A step planned and staged beside the previous one's forward."""

    plan: StepPlan
    staged: Staged
    turns: list[TurnRequest]        # each decode row's turn, in plan order


@dataclass
class AheadCounts:
    """Steps staged ahead since the engine started: launched as staged, or dropped (planned again)."""

    staged: int = 0
    launched: int = 0
    dropped: int = 0


def plain_step(plan: StepPlan) -> bool:
    """Whether `plan` is decode rows alone, none tracked by a pending GDN join (what a step staged ahead is)."""
    return bool(plan.segments) and all(s.kind is Kind.DECODE and not s.tracked for s in plan.segments)


def continues(turn: TurnRequest) -> bool:
    """Whether `turn`'s next step is another plain decode row, as far as can be told before this step's
    token is drawn: it decodes, no deferred rows of its session are pending, it shares steps, and it has room
    for two more tokens (the one drawn now and the next)."""
    return (turn.decoding and not turn.finished and turn.cache.recovery is None
            and turn.cache.queued is None and not turn.cache.deterministic
            and turn.params.max_new_tokens - len(turn.generated) >= 2)
