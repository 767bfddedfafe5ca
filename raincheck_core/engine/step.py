"""One engine step, whole: schedule -> run -> update -> settle.

    plan = scheduler.schedule()                 # which rows of which sessions, claimed slots (engine/scheduler.py)
    out = runner.run(core.resolve(plan), ops)   # tensors, one forward, new states as data (engine/runner.py)
    core.settle(apply_step(plan, out, ...))     # sessions change, then what ended is settled (engine/update.py,
                                                # engine/core.py)

A forward that raises changes nothing: the plan's claims are dropped. If the step held several
sessions, each session's share is re-run alone, so only the one whose own rows fail is hit: its turn
fails with `StepFailedError` and is undone to its admission (its cache as before the turn), or, for a
post-answer recovery, the chunk is retried and the recovery given up after `MAX_RECOVERY_FAILURES`.

A deferred worker's result is joined by a step of its own (`run_handoff`): its plan is the recovery's
hand-off segment, whose run computes the join and whose update applies it like a chunk's; if it fails,
nothing is applied and the caller is told.

The loops over steps are the stepper's (engine/stepper.py), the only caller. A step reaches the core
through `StepCore`, what it reads and calls of it (engine/core.py implements it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..errors import StepFailedError
from .plan import StepPlan
from .step_sessions import StepSessions
from .update import StepResult, apply_step, chunk_carriers

if TYPE_CHECKING:
    from ..cache.gdn_state import GDNStatePool
    from ..ops.backend import GDNOps, OpSet
    from ..ops.gdn_traffic import GDNTraffic
    from .ahead import Ahead, StepsAhead
    from .hooks import Hooks
    from .runner import ModelRunner
    from .scheduler import Scheduler
    from .session_cache import SessionCache

log = logging.getLogger(__name__)


class StepCore(StepSessions, Protocol):
    """What a step reads and calls of the engine core (engine/core.py implements it; the sessions the
    update reads are `StepSessions`)."""

    clock: Callable[[], float]
    scheduler: Scheduler
    runner: ModelRunner
    hooks: Hooks
    gdn: GDNStatePool | None
    ahead: StepsAhead       # the next decode step staged during a step's forward (engine/ahead.py)

    def resolve(self, plan: StepPlan, gdn_ops: GDNOps) -> StepPlan: ...

    def stepped(self, plan: StepPlan, seconds: float, failed: bool, gdn_traffic: GDNTraffic | None = None
                ) -> None: ...

    def cancel(self, plan: StepPlan) -> None: ...

    def settle(self, result: StepResult) -> None: ...

    def step_failed(self, cache: SessionCache, error: Exception) -> None: ...


def run_step(core: StepCore, only: SessionCache | None = None) -> bool:
    """One step (call under the engine lock): the one staged ahead during the last, if it still is the step to
    run (engine/ahead.py), else planned now. False when there was no work."""
    t0 = core.clock()
    ahead = core.ahead.take(only)
    plan = ahead.plan if ahead is not None else core.scheduler.schedule(only)
    if not plan:
        return False
    error, traffic = _run(core, plan, ahead)
    core.stepped(plan, core.clock() - t0, failed=error is not None, gdn_traffic=traffic)
    if error is None:
        return True
    sessions = plan.sessions()
    if len(sessions) == 1:
        core.step_failed(core.cache(sessions[0]), error)
        return True
    log.warning("a step of %d sessions failed (%s); re-running each session alone", len(sessions), error)
    for sid in sessions:
        cache = core.cache(sid)
        alone = core.scheduler.schedule(only, solo=cache)
        if alone and (e := _run(core, alone)[0]) is not None:
            core.step_failed(cache, e)
    return True


def run_handoff(core: StepCore, cache: SessionCache) -> None:
    """The step joining the result the core holds for `cache` (`EngineCore.handing_in`) into its recovery's
    pending rows (call under the engine lock). StepFailedError, with nothing applied, if it fails."""
    core.ahead.drop()       # the hand-off's step comes first
    t0 = core.clock()
    plan = core.scheduler.handoff(cache)
    error, _ = _run(core, plan)
    core.stepped(plan, core.clock() - t0, failed=error is not None)
    if error is not None:
        raise StepFailedError(f"joining the deferred worker's result failed: {error}") from error


def _run(core: StepCore, plan: StepPlan, ahead: Ahead | None = None) -> tuple[Exception | None, GDNTraffic | None]:
    """Run the plan's passes (`ahead`: the plan's one pass was staged during the last step); what their
    updates found ended is settled once, after the last pass that ran (a serial chunk's pass may complete a
    recovery whose turn's decode row the next pass tracks). A one-pass step's update may stage the next step
    before it reads the forward's values (`StepsAhead.stage`). Returns the error, if a pass raised, and
    the GDN state traffic of the passes (None: no GDN layers)."""
    passes = [plan] if ahead is not None else plan.passes()
    restoring = chunk_carriers(plan)
    result = StepResult()
    error, traffic = None, None
    # once per step: every pass, the joins' folds and the update run on it (a staged step's: the one it was
    # staged on)
    ops = ahead.staged.ops if ahead is not None else core.runner.ops()
    for i, part in enumerate(passes):
        try:
            try:
                for hook in core.hooks.plan:
                    hook(part)
            except Exception:
                core.runner.skip()
                raise
            # what the runner reads of the sessions, read now: as the step's earlier passes left them
            out = core.runner.launch(ahead.staged) if ahead is not None else \
                core.runner.run(core.resolve(part, ops.gdn), ops)
        except Exception as e:
            for rest in passes[i:]:
                core.cancel(rest)
            error = e
            break
        if out.gdn_traffic is not None:
            traffic = out.gdn_traffic if traffic is None else traffic + out.gdn_traffic
        reading = core.hooks.reading(part)
        void = ahead.void if ahead is not None else frozenset()
        if len(passes) == 1 and core.ahead.on:
            reading = _staging_ahead(core, part, ops, reading, void)
        try:
            applied = apply_step(part, out, core, core.gdn, ops.gdn, core.clock(), restoring, reading, void)
        except BaseException:
            core.ahead.drop()
            raise
        if not core.ahead.survives(applied):      # what the next step was staged for is not so any more
            core.ahead.drop()
        result.extend(applied)
    core.settle(result)
    return error, traffic


def _staging_ahead(core: StepCore, plan: StepPlan, ops: OpSet, hook: Callable[[], None] | None,
                   void: frozenset[str]) -> Callable[[], None]:
    """What the update calls before it first reads the forward's values: the next step staged (if it may
    be; `void`: the sessions whose rows in `plan` are void), then `hook`."""
    def read() -> None:
        core.ahead.stage(plan, ops, void)
        if hook is not None:
            hook()
    return read
