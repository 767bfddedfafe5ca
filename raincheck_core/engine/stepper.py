"""Who steps the engine: whoever waits for a turn's next event, and a background thread for the rest.

There is no engine thread of its own: a consumer reading a turn's events drives the steps (`drive`),
under the engine lock, so embedded use needs no threads and concurrent callers share steps. The
optional background stepper steps whenever there is work nobody is waiting for — chiefly post-answer
recovery in the gaps between turns — and leaves the steps to consumers while any drives. The loops over
steps are here (each step is engine/step.py's `run_step`); the engine core holds the state and makes
the transitions they call for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..deferral.handoff import ResidualResult
from ..errors import StepFailedError
from .core import EngineCore
from .engine_lock import EngineLock
from .request import TurnRequest
from .session_cache import SessionCache
from .step import run_handoff, run_step

log = logging.getLogger(__name__)


class Stepper:
    def __init__(self, core: EngineCore, lock: EngineLock):
        self.core = core
        self.lock = lock
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._drivers = 0                 # consumers inside drive(): the background stepper leaves steps to them
        self._drivers_lock = threading.Lock()
        self._wake = threading.Event()

    def step(self, only: SessionCache | None = None) -> bool:
        """One step over every running turn (and recoveries in the gaps; only `only`'s when given)."""
        with self.lock.for_step(), self.core.replicate("step", None if only is None else only.session):
            return run_step(self.core, only)

    def drive(self, *requests: TurnRequest) -> None:
        """Step until one of `requests` has an event to hand out or all have ended. A consumer waits for the lock like
        any caller (not behind the background stepper, which would otherwise keep it through a whole
        post-answer recovery once the consumer's event was already there)."""
        with self._drivers_lock:
            self._drivers += 1
        try:
            while _waiting(requests):
                with self.lock.for_reading():
                    if _waiting(requests):
                        self.step()
        finally:
            with self._drivers_lock:
                self._drivers -= 1

    def complete_recovery(self, cache: SessionCache, enough: Callable[[], bool] | None = None) -> int:
        """Run `cache`'s deferred rows to the end (the completion barrier), or until `enough()` holds
        (a bounded barrier; checked before each step). Returns the steps it ran."""
        steps = 0
        while cache.recovery is not None:
            with self.lock:
                if cache.recovery is None or (enough is not None and enough()):
                    break
                with self.lock.for_step():
                    self._barrier_step(cache)
                steps += 1
        return steps

    def prefill_scratch(self, cache: SessionCache) -> None:
        """Prefill a scratch session's rows (`EngineCore.scratch_session`: a deferred worker's residual)
        through the ordinary step, shared with the running turns' rows; other sessions' post-answer
        recovery waits, as for a barrier. Call under the engine lock. StepFailedError if a step holding
        only these rows fails."""
        work = self.core.queue_scratch(cache)
        while work.pending and work.error is None:
            run_step(self.core, only=cache)
        if work.error is not None:
            raise StepFailedError(f"the forward pass prefilling the rows failed: {work.error}") from work.error

    def hand_in(self, cache: SessionCache, result: ResidualResult) -> None:
        """Join a deferred worker's `result` into `cache`'s recovery, its rows from the cursor on, in one step
        of their own (engine/residual.py checked that it may join now). Call under the engine lock.
        StepFailedError, with nothing applied, if that step fails."""
        with self.core.handing_in(cache, result):
            run_handoff(self.core, cache)

    def _barrier_step(self, cache: SessionCache) -> None:
        """One step towards the end of `cache`'s recovery (the completion barrier): the answer first if
        it still streams, else prefill-only chunks of it shared with whatever else runs; a recovery held
        for a deferred worker whose result is not back is recovered locally too."""
        if not cache.recovery.answer_done:
            run_step(self.core)
            return
        self.core.race_held(cache)
        if not run_step(self.core, only=cache):
            self.core.requeue_recovery(cache)

    def start_background(self, after_step: Callable[[], None] | None = None, idle_wait_s: float = 0.02) -> None:
        """Step in a daemon thread whenever there is work nobody is waiting for; `after_step` runs after
        each step and each idle wait (the services observe recoveries there)."""
        if self._background is not None:
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                stepped = False
                try:
                    # a consumer driving its turn steps for everyone: stepping too would only trade the
                    # lock back and forth
                    stepped = not self._drivers and self.core.has_work() and self.step()
                    if after_step is not None:
                        after_step()
                except Exception:   # keep stepping; a failing turn gets its error from the step
                    log.exception("background engine step failed")
                if not stepped:
                    self._wake.wait(idle_wait_s)
                    self._wake.clear()

        thread = threading.Thread(target=loop, name="raincheck-engine-steps", daemon=True)
        self._background = (thread, stop)
        thread.start()

    def wake(self) -> None:
        """Tell the background stepper there is work now (instead of at its next idle check)."""
        self._wake.set()

    def stop_background(self) -> None:
        if self._background is not None:
            thread, stop = self._background
            stop.set()
            self._wake.set()
            thread.join(timeout=10)
            self._background = None


def _waiting(requests: tuple[TurnRequest, ...]) -> bool:
    return not any(r.events for r in requests) and not all(r.finished for r in requests)
