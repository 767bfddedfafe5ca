"""One engine step, whole: schedule -> run -> update.

    plan = scheduler.schedule()       # which rows of which sessions, claimed slots (engine/scheduler.py)
    out  = runner.run(plan)           # tensors, one forward, new states as data (engine/runner.py)
    apply_step(engine, plan, out)     # the only place sessions change (engine/update.py)

A forward that raises changes nothing: the plan's claims are dropped. If the step held several
sessions, each session's share is re-run alone, so only the one whose own rows fail is hit: its turn
fails with `StepFailedError` and is undone to its admission (its cache as before the turn), or, for a
post-answer recovery, the chunk is retried and the recovery given up after `MAX_RECOVERY_FAILURES`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .plan import StepPlan
from .session_cache import SessionCache
from .update import apply_step, chunk_carriers

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


def run_step(engine: Engine, only: SessionCache | None = None) -> bool:
    """One step (call under the engine lock). False when there was no work."""
    t0 = engine.clock()
    plan = engine.scheduler.schedule(only)
    if not plan:
        return False
    error = _run(engine, plan)
    if error is None:
        engine.scheduler.account(plan, engine.clock() - t0)   # what the TPOT objective learns from
        return True
    caches = plan.caches()
    if len(caches) == 1:
        engine._step_failed(caches[0], error)
        return True
    log.warning("a step of %d sessions failed (%s); re-running each session alone", len(caches), error)
    for cache in caches:
        alone = engine.scheduler.schedule(only, solo=cache)
        if alone and (e := _run(engine, alone)) is not None:
            engine._step_failed(cache, e)
    return True


def _run(engine: Engine, plan: StepPlan) -> Exception | None:
    passes = plan.passes()
    restoring = chunk_carriers(plan)
    for i, part in enumerate(passes):
        try:
            out = engine.runner.run(part)
        except Exception as e:
            for rest in passes[i:]:
                rest.cancel()
            return e
        apply_step(engine, part, out, restoring)
    return None
