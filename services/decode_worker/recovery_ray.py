"""`disaggregated` recovery: a turn's post-answer remainder is prefilled by a Ray deferred worker.

At the answer's end the residual is exported (`export_residual`: the K/V the deferred rows may see, the
GDN prefix state, the rows) and shipped to a deferred-worker actor; its K/V, prefix-state delta and conv
history come back and are joined under the engine lock (`apply_residual`). Local gap recovery stays off
for the session meanwhile. If the actor dies, fails or misses the deadline, the recovery is taken back
(`take_back`) and the engine finishes it in its gaps: a recovery is never lost, and the session's next
turn passes the engine's barrier, which also takes back a shipped recovery that has not come back.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from raincheck_core.deferral.handoff import ResidualResult, apply_residual, export_residual, hold, take_back
from raincheck_core.deferral.recovery import Recovery

from ..common.logs import bind
from ..common.metrics import RECOVERY_BYTES, RECOVERY_FALLBACKS, RECOVERY_LATENCY
from ..deferred_worker.pool import DeferredPool, NoDeferredWorkerError
from ..deferred_worker.wire import pack, unpack
from .recovery import RecoveryBackend
from .sessions import WorkerSession

log = logging.getLogger(__name__)
WAIT_S = 0.05           # how often a shipped recovery checks whether it is still wanted


@dataclass(eq=False)
class _Job:
    """One turn's remainder, from its answer's end until it is joined (here or by the engine)."""

    ws: WorkerSession
    rec: Recovery
    shipped: int = 0        # bytes sent to the deferred worker
    local: bool = False     # the engine finishes it (taken back, or done by the next turn's barrier)

    def current(self) -> bool:
        """Still this backend's to finish (exact under the engine lock; a hint without it)."""
        return not self.ws.session.closed and self.ws.session.seq.recovery is self.rec and self.rec.handed_off


class DisaggregatedRecovery(RecoveryBackend):
    mode = "disaggregated"

    def __init__(self, pool: DeferredPool, timeout_s: float, max_in_flight: int = 32):
        self.pool = pool
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="raincheck-deferred")
        self._lock = threading.Lock()
        self._held: dict[str, tuple[WorkerSession, Recovery]] = {}   # answer streaming, not shipped yet
        self._jobs: dict[Recovery, _Job] = {}
        self._stopping = threading.Event()

    def start(self) -> None:
        self.pool.start()

    def stop(self) -> None:
        self._stopping.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pool.stop()

    def turn_started(self, ws: WorkerSession) -> None:
        """Keep the engine's gap recovery off this turn's remainder: it is shipped at the answer's end
        (fused chunks still ride on the turn's decode steps). This sets the engine's hand-off mark right
        after admission; only a turn that ends within a step or two can lose that race, and then some
        of its rows are simply recovered locally first."""
        rec = hold(ws.session.engine, ws.session)
        if rec is None:
            return
        with self._lock:
            self._held[ws.id] = (ws, rec)

    def answer_done(self, ws: WorkerSession) -> None:
        with self._lock:
            held = self._held.pop(ws.id, None)
            if held is None:
                return
            job = self._jobs[held[1]] = _Job(ws, held[1])
        self._executor.submit(self._run, job)

    def pending(self, ws: WorkerSession) -> int:
        return ws.session.pending_deferred

    def forget(self, ws: WorkerSession) -> None:
        with self._lock:
            self._held.pop(ws.id, None)
            for rec in [rec for rec, job in self._jobs.items() if job.ws is ws]:
                del self._jobs[rec]

    def poll(self) -> None:
        """Ship the remainders of turns that ended without `answer_done` (abandoned or failed streams),
        and observe the recoveries the engine finished after a take-back."""
        with self._lock:
            for sid in [sid for sid, (_, rec) in self._held.items() if rec.done]:   # all fused in the answer
                del self._held[sid]
            ended = [ws for ws, rec in self._held.values() if rec.answer_done and not ws.active]
            finished = [job for job in self._jobs.values() if job.local and job.rec.done]
            for job in finished:
                del self._jobs[job.rec]
        for ws in ended:
            self.answer_done(ws)
        for job in finished:
            self._observe(job, job.shipped)

    # ---------------------------------------------------------------- one recovery
    def _run(self, job: _Job) -> None:
        engine = job.ws.session.engine
        try:
            with engine.lock:
                if not job.current():   # the next turn's barrier took it first
                    job.local = True
                    return
                payload = export_residual(engine, job.ws.session)
            job.shipped = payload.nbytes()
            reply = self._remote(job, pack(payload))
            with engine.lock:
                applied = reply is not None and job.current()
                if applied:
                    result, compute_s = reply
                    apply_residual(engine, job.ws.session, result)
        except Exception as e:   # the deferred worker failed: finish here (a recovery is never lost)
            reason = "timeout" if isinstance(e, TimeoutError) else "worker_died" if isinstance(e, RayActorError) \
                else "no_worker" if isinstance(e, NoDeferredWorkerError) else "error"
            bind(log, session_id=job.ws.id).warning("deferred worker failed (%s: %s); recovering %d tokens "
                                                    "locally", reason, e, job.rec.pending)
            RECOVERY_FALLBACKS.labels(reason).inc()
            applied = False
        if not applied:
            self._take_back(job)
            return
        with self._lock:
            self._jobs.pop(job.rec, None)
        nbytes = job.shipped + result.nbytes()
        bind(log, session_id=job.ws.id).info(
            "%d deferred tokens recovered on a deferred worker in %.3fs (%.3fs of it prefill; %d bytes shipped)",
            payload.rows, job.rec.completion_s, compute_s, nbytes)
        self._observe(job, nbytes)

    def _take_back(self, job: _Job) -> None:
        """The engine finishes this remainder (or has finished it): `poll` observes it when done."""
        engine = job.ws.session.engine
        with engine.lock:
            if job.current():
                take_back(engine, job.ws.session)
        job.local = True

    def _remote(self, job: _Job, wire: dict) -> tuple[ResidualResult, float] | None:
        """Prefill on a deferred worker: the result and the actor's compute time; None once the recovery
        is no longer this backend's or the worker stops. TimeoutError past the deadline; Ray's errors
        when the actor fails."""
        actor = self.pool.pick()
        ref = actor.prefill.remote(wire)
        deadline = (job.rec.t_answer_end or time.perf_counter()) + self.timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=WAIT_S)
            if ready:
                break
            if self._stopping.is_set() or not job.current():
                return None
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no result within {self.timeout_s:g}s of the answer's end")
        try:
            reply = ray.get(ref)
        except RayActorError:
            self.pool.lost(actor)
            raise
        return unpack(ResidualResult, reply["result"], job.ws.session.engine.device), reply["compute_s"]

    def _observe(self, job: _Job, nbytes: int) -> None:
        RECOVERY_LATENCY.labels(self.mode).observe(job.rec.completion_s)
        RECOVERY_BYTES.labels(self.mode).observe(nbytes)
