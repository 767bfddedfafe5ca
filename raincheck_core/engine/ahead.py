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

A step staged ahead is a bet that nothing changes in between. A turn that ends in this step (a stop token, its
length) keeps it where nothing else follows from the end (`voidable`: no deferred rows left to recover after
the answer, the session's own answer): the staged step runs with that turn's decode row void, as vLLM's async
scheduling computes a finished request's one extra token and drops it; the update keeps nothing of the row
(its claim cancelled, its GDN state left in the row that is not current). A post-answer recovery that completes
in this step keeps it too: the plan saw it with nothing pending and gave it no rows. Otherwise the core drops the
staged step (its claims cancelled, as a failed forward's are) when this step ends, fails or forks a turn or
completes a recovery with a later turn's queued behind it (`StepsAhead.survives`), when
anything but a step loop or a reader takes the engine lock (an admission, a cancel, a close: `EngineLock`'s
`on_hold`), and when the next step finds the running or recovering sessions changed; that step is then planned
as it would have been.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .plan import Kind, StepPlan

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..ops.backend import GDNOps, OpSet
    from .request import TurnRequest
    from .runner import ModelRunner
    from .scheduler import Scheduler
    from .session_cache import SessionCache
    from .step_inputs import Staged
    from .update import StepResult

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """A step planned and staged beside the previous one's forward."""

    plan: StepPlan
    staged: Staged
    turns: list[TurnRequest]        # each decode row's turn, in plan order
    recovering: list[SessionCache]  # the sessions recovering after their answer then (the scheduler's list)
    void: frozenset[str] = frozenset()  # sessions whose turn ended before the step ran: their rows are dropped


@dataclass
class AheadCounts:
    """Steps staged ahead since the engine started: launched as staged, or dropped (planned again)."""

    staged: int = 0
    launched: int = 0
    dropped: int = 0
    void_rows: int = 0      # decode rows of launched steps whose turn had ended (computed, dropped)


# what a step staged ahead holds: the running turns' decode rows, the deferred chunks fused into them, and other
# sessions' post-answer chunks in the budget they leave
STAGED_KINDS = frozenset({Kind.DECODE, Kind.DEFERRED, Kind.RECOVERY})


def decode_step(plan: StepPlan) -> bool:
    """Whether `plan` is decode rows and deferred chunks alone, in one pass (what a step staged ahead is)."""
    return bool(plan.segments) and all(s.kind in STAGED_KINDS and not s.serial and s.rows for s in plan.segments)


def voidable(turn: TurnRequest) -> bool:
    """Whether a step staged with a decode row of `turn` may still run once `turn` has ended, that row void:
    the end starts nothing in the step's place (no deferred rows to recover after the answer: the recovering
    sessions stay as planned) and frees nothing the step writes to (the session's own answer, whose session
    lives on; an `n > 1` turn's other answers release their pages when they end)."""
    return turn.cache.recovery is None and turn.choice == 0


def continues(turn: TurnRequest) -> bool:
    """Whether `turn` has a row in the next step, as far as can be told before this step's token is drawn: it
    decodes and shares steps, and has room for two more tokens (the one drawn now and the next), or, ending
    with this step's token, its next row may be void (`voidable`)."""
    return (turn.decoding and not turn.finished and not turn.cache.deterministic
            and (turn.params.max_new_tokens - len(turn.generated) >= 2 or voidable(turn)))


class AheadCore(Protocol):
    """What staging a step ahead reads and calls of the engine core (engine/core.py implements it)."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner
    turns: Mapping[str, TurnRequest]
    handoffs: Mapping[str, object]

    def resolve(self, plan: StepPlan, gdn_ops: GDNOps) -> StepPlan: ...

    def cancel(self, plan: StepPlan) -> None: ...


class StepsAhead:
    """The engine core's step staged ahead, and its transitions: staged (`stage`), launched (`take`) or
    dropped (`drop`). `on`: whether steps are staged at all (`Engine.stage_ahead` switches it); `one_rank`: the
    engine runs alone (no tensor-parallel ranks, no mirror)."""

    def __init__(self, core: AheadCore, one_rank: bool):
        self.core = core
        # where the forward runs beside the host (a GPU) unless the config says otherwise; never across ranks,
        # whose steps are compared before they run
        asked = core.config.plan_ahead
        self.on = (asked if asked is not None else core.runner.device.type == "cuda") and one_rank
        self.pending: Ahead | None = None
        self.counts = AheadCounts()

    def stage(self, plan: StepPlan, ops: OpSet, void: frozenset[str] = frozenset()) -> None:
        """`plan`'s update has done its bookkeeping and its forward may still run: if `plan` is a decode step
        (decode rows, fused chunks) of every running turn (and of the ended turns in `void`, their rows void) and
        the next one will be too, plan that one and stage its inputs now."""
        core = self.core
        scheduler, running = core.scheduler, core.scheduler.running
        if not (self.on and ops.attention.reads_pages and self.pending is None
                and scheduler.speculation is None and not scheduler.scratch and not core.handoffs
                and 0 < len(running) == plan.count(Kind.DECODE) - len(void) <= core.config.max_rows_per_step
                and decode_step(plan) and all(map(continues, running))):
            return
        try:
            # planned as after this step's row: one more answer row fed (it moves the fused chunks' guard)
            nxt = scheduler.schedule(fed_ahead=1)
            # a decode row a running turn, in their order (the drawn tokens are written in in that order)
            if not decode_step(nxt) or [s.session for s in nxt.segments if s.kind is Kind.DECODE] != \
                    [r.cache.session for r in running]:
                core.cancel(nxt)
                return
            staged = core.runner.stage(core.resolve(nxt, ops.gdn), ops, ahead=True)
        except Exception:   # planning it now was a guess: the next step is planned as usual (and fails there)
            log.warning("staging the next decode step ahead failed; it is planned when it runs", exc_info=True)
            for req in running:
                req.cache.cancel_claims()
            return
        self.pending = Ahead(nxt, staged, list(running), list(scheduler.recovering))
        self.counts.staged += 1

    def take(self, only: SessionCache | None) -> Ahead | None:
        """The step staged ahead, its tokens written in, if it is still the step to run (`only`: the step
        asked for is restricted, which a staged step never is; a turn of it that ended leaves its row void, but
        a step of void rows alone is not run); else None, the staged step dropped."""
        ahead = self.pending
        if ahead is None:
            return None
        scheduler = self.core.scheduler
        running, recovering = scheduler.running, scheduler.recovering
        live = [t for t in ahead.turns if not t.finished]
        ended = [t for t in ahead.turns if t.finished]
        # the recoveries that completed meanwhile have left the list; the plan gave them no rows
        still = {id(c) for c in recovering}
        kept = [c for c in ahead.recovering if id(c) in still]
        if only is not None or scheduler.scratch or not live or len(running) != len(live) \
                or any(r is not t for r, t in zip(running, live, strict=True)) \
                or not all(map(voidable, ended)) \
                or len(recovering) != len(kept) \
                or any(c is not k for c, k in zip(recovering, kept, strict=True)):
            self.drop()
            return None
        self.pending = None
        ahead.void = frozenset(t.cache.session for t in ended)
        ahead.staged.retoken([t.last_token for t in ahead.turns])
        self.counts.launched += 1
        self.counts.void_rows += len(ended)
        return ahead

    def survives(self, result: StepResult) -> bool:
        """Whether the step staged ahead is still the next step once `result` is settled: nothing fails or
        forks, what ends may leave its row void (`voidable`), and the recoveries it completes have no later
        turn's recovery queued behind and are of sessions still answering (the staged rows were planned as after
        that: the session's decode row tracks no join of a recovery done, and fuses nothing) or have no rows in
        the staged step (a post-answer recovery: the plan saw it with nothing pending and gave it none)."""
        if result.failed or result.forked or not all(map(voidable, result.ended)):
            return False
        planned = set(self.pending.plan.sessions()) if self.pending is not None else set()
        return all(cache.queued is None and (self.core.turns.get(cache.session) is not None
                                             or cache.session not in planned)
                   for cache, _ in result.recovered)

    def drop(self) -> None:
        """Drop the step staged ahead, if any: its claims go back, as a failed forward's do."""
        if self.pending is not None:
            self.core.cancel(self.pending.plan)
            self.pending = None
            self.counts.dropped += 1
