"""`disaggregated` recovery: a turn's post-answer remainder is prefilled by a Ray deferred worker.

When a turn is admitted its recovery is held for this backend (`Engine.hold_residual`, a ticket naming
it); at the answer's end the residual is exported (the K/V the deferred rows may see, the GDN prefix
state, the rows), shipped to a deferred-worker actor, and what comes back is joined
(`Engine.apply_residual`). If the actor dies, fails or misses the deadline, the recovery is taken back
(`Engine.take_back`) and the engine finishes it in its gaps: a recovery is never lost, and the
session's next turn passes the engine's barrier, which also finishes a shipped recovery that has not
come back. The engine refuses a result whose ticket is no longer current, so a late result is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from raincheck_core.deferral.handoff import ResidualResult
from raincheck_core.errors import RecoveryStateError

from ..common.logs import bind
from ..common.metrics import (
    DEFERRED_QUEUE,
    DEFERRED_QUEUE_WAIT,
    RECOVERY_BYTES,
    RECOVERY_FALLBACKS,
    RECOVERY_LATENCY,
)
from ..deferred_worker.bridge import DeferredWorkerError, RayBridge
from ..deferred_worker.wire import pack, unpack
from .recovery import RecoveryBackend
from .sessions import WorkerSession

log = logging.getLogger(__name__)
WAIT_S = 0.05           # how often a shipped recovery checks whether it is still wanted

@dataclass(eq=False)
class _Job:
    """One turn's remainder, from its answer's end until it is joined (here or by the engine)."""

    ws: WorkerSession
    ticket: int
    shipped: int = 0        # bytes sent to the deferred worker
    local: bool = False     # the engine finishes it (taken back, or done by the next turn's barrier)
    t_answer_end: float = field(default_factory=time.perf_counter)

    def current(self) -> bool:
        """Still this backend's to finish (a hint: the engine's verbs check it exactly)."""
        status = self.ws.session.status()
        return not status.closed and status.recovery_ticket == self.ticket and status.handed_off

    def finished(self) -> bool:
        """The engine has no recovery by this ticket any more (joined, or finished locally)."""
        status = self.ws.session.status()
        return status.closed or status.recovery_ticket != self.ticket


class DisaggregatedRecovery(RecoveryBackend):
    mode = "disaggregated"

    def __init__(self, bridge: RayBridge, timeout_s: float, worker_id: str = "", max_in_flight: int = 32):
        self.bridge = bridge
        self.worker_id = worker_id
        bridge.on_queue = lambda depth: DEFERRED_QUEUE.labels(worker_id).set(depth)
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="raincheck-deferred")
        self._lock = threading.Lock()
        self._held: dict[str, tuple[WorkerSession, int]] = {}   # answer streaming, not shipped yet
        self._jobs: dict[tuple[str, int], _Job] = {}
        self._stopping = threading.Event()

    def start(self) -> None:
        self.bridge.start()

    def stop(self) -> None:
        self._stopping.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.bridge.stop()
        DEFERRED_QUEUE.remove(self.worker_id)

    def watch(self, on_change: Callable[[bool], None]) -> None:
        self.bridge.on_state = on_change

    def turn_started(self, ws: WorkerSession) -> None:
        """Keep the engine's gap recovery off this turn's remainder: it is shipped at the answer's end
        (fused chunks still ride on the turn's decode steps). This holds the recovery right after
        admission; only a turn that ends within a step or two can lose that race, and then some of its
        rows are simply recovered locally first. Without Ray nothing is held: the engine recovers the turn
        as colocated would."""
        if not self.bridge.connected:
            return
        ticket = ws.session.engine.hold_residual(ws.session)
        if ticket is None:
            return
        with self._lock:
            self._held[ws.id] = (ws, ticket)

    def answer_done(self, ws: WorkerSession) -> None:
        with self._lock:
            held = self._held.pop(ws.id, None)
            if held is None:
                return
            job = self._jobs[(ws.id, held[1])] = _Job(ws, held[1])
        self._executor.submit(self._run, job)

    def pending(self, ws: WorkerSession) -> int:
        return ws.session.pending_deferred

    def forget(self, ws: WorkerSession) -> None:
        with self._lock:
            self._held.pop(ws.id, None)
            for key in [key for key, job in self._jobs.items() if job.ws is ws]:
                del self._jobs[key]

    def poll(self) -> None:
        """Ship the remainders of turns that ended without `answer_done` (abandoned or failed streams),
        and observe the recoveries the engine finished after a take-back."""
        with self._lock:
            held = list(self._held.values())
            jobs = list(self._jobs.values())
        ended = []
        for ws, ticket in held:
            status = ws.session.status()
            if status.recovery_ticket != ticket:          # all fused during the answer, or closed
                with self._lock:
                    self._held.pop(ws.id, None)
            elif status.recovering and not ws.active:
                ended.append(ws)
        finished = [job for job in jobs if job.local and job.finished()]
        with self._lock:
            for job in finished:
                self._jobs.pop((job.ws.id, job.ticket), None)
        for ws in ended:
            self.answer_done(ws)
        for job in finished:
            self._observe(job, job.shipped)

    # ---------------------------------------------------------------- one recovery
    def _run(self, job: _Job) -> None:
        engine, session = job.ws.session.engine, job.ws.session
        applied = False
        try:
            try:
                payload = engine.export_residual(session, job.ticket)
            except RecoveryStateError:   # the next turn's barrier took it first, or the session closed
                job.local = True
                return
            job.shipped = payload.nbytes()
            bind(log, session_id=job.ws.id).info("shipping %d deferred tokens to a deferred worker (%d bytes)",
                                                 payload.rows, job.shipped)
            reply = self._remote(job, pack(payload))
            if reply is not None:
                result, compute_s = reply
                try:
                    engine.apply_residual(session, job.ticket, result)
                    applied = True
                except RecoveryStateError:   # taken back or finished meanwhile: the result is dropped
                    pass
        except Exception as e:   # the deferred worker failed: finish here (a recovery is never lost)
            reason = "timeout" if isinstance(e, TimeoutError) else e.reason if isinstance(e, DeferredWorkerError) \
                else "error"
            bind(log, session_id=job.ws.id).warning("deferred worker failed (%s: %s); recovering %d tokens "
                                                    "locally", reason, e, session.pending_deferred)
            RECOVERY_FALLBACKS.labels(reason).inc()
        if not applied:
            self._take_back(job)
            return
        with self._lock:
            self._jobs.pop((job.ws.id, job.ticket), None)
        nbytes = job.shipped + result.nbytes()
        bind(log, session_id=job.ws.id).info(
            "%d deferred tokens recovered on a deferred worker in %.3fs (%.3fs of it prefill; %d bytes shipped)",
            payload.rows, time.perf_counter() - job.t_answer_end, compute_s, nbytes)
        self._observe(job, nbytes)

    def _take_back(self, job: _Job) -> None:
        """The engine finishes this remainder (or has finished it): `poll` observes it when done."""
        job.ws.session.engine.take_back(job.ws.session, job.ticket)
        job.local = True

    def _remote(self, job: _Job, wire: dict) -> tuple[ResidualResult, float] | None:
        """Prefill on a deferred worker: the result and the actor's compute time; None once the recovery
        is no longer this backend's or the worker stops. TimeoutError past the deadline;
        DeferredWorkerError when the deferred workers fail it."""
        future = self.bridge.prefill(job.ws.id, None, {"payload": wire})
        deadline = job.t_answer_end + self.timeout_s
        while True:
            try:
                reply = future.result(timeout=WAIT_S)
                break
            except FutureTimeout:
                pass
            if self._stopping.is_set() or not job.current():
                self.bridge.cancel(future)
                return None
            if time.perf_counter() > deadline:
                self.bridge.cancel(future)
                raise TimeoutError(f"no result within {self.timeout_s:g}s of the answer's end")
        DEFERRED_QUEUE_WAIT.observe(reply["wait_s"])
        return unpack(ResidualResult, reply["result"], job.ws.session.engine.device), reply["compute_s"]

    def _observe(self, job: _Job, nbytes: int) -> None:
        RECOVERY_LATENCY.labels(self.mode).observe(job.ws.session.status().last_recovery_s or 0.0)
        RECOVERY_BYTES.labels(self.mode).observe(nbytes)
