"""`disaggregated` recovery: a turn's deferred residual is prefilled by a Ray deferred worker.

When a turn is admitted its recovery is held for this backend (`Engine.hold_residual`, a ticket naming
it). The residual is exported (the K/V the deferred rows may see, the GDN prefix state, the rows) at the
answer's end, or, with `ship = input_done` (in flight), as soon as the turn's input is prefilled; it goes
to a deferred-worker actor through the decode worker's Ray driver process (`deferred_worker/bridge.py`),
and what comes back is joined (`Engine.apply_residual`): mid-answer where a fused chunk could be joined,
else after the answer. Fused chunks may restore a prefix of the shipped rows meanwhile; the engine joins
only the rest, so each row is restored once.

Session-resident context (`deferred_worker/resident.py`): a session's recoveries go to the actor that
ran its last one (recorded here: the affinity), which keeps the context it prefilled on; a recovery then
ships only the rows that actor lacks (the answer since, the turn's input, fused chunks) and names the
copy it relies on. A miss (the actor is gone, busy too long, evicted the copy, restarted) ships the whole
context again to any actor, counted in `raincheck:deferred_resident_misses_total`. A copy made while a
turn streamed is void if that turn is undone.

If the actor dies, fails or misses the deadline, the recovery is taken back (`Engine.take_back`) and
the engine finishes it in its gaps: a recovery is never lost. The session's next turn passes the
engine's barrier, which recovers a residual still out locally too; the result is joined if it comes
first. The engine refuses a result whose ticket or recovery is no longer current, so a late result
(the session closed, the turn undone or cancelled) is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from raincheck_core.deferral.handoff import Joined, ResidualPayload, ResidualResult
from raincheck_core.engine import TurnStream
from raincheck_core.errors import RecoveryStateError

from ..common.logs import bind
from ..common.metrics import (
    DEFERRED_QUEUE,
    DEFERRED_QUEUE_WAIT,
    RECOVERY_BYTES,
    RECOVERY_FALLBACKS,
    RECOVERY_LATENCY,
    RESIDENT_MISSES,
)
from ..common.settings import DeferredSettings
from ..deferred_worker.bridge import DeferredWorkerError, RayBridge
from ..deferred_worker.messages import Adopt, Base, PrefillReply, PrefillRequest
from ..deferred_worker.resident import adopted_fingerprint, chain, shipped_fingerprint
from ..deferred_worker.wire import pack, unpack
from .recovery import RecoveryBackend
from .sessions import WorkerSession

log = logging.getLogger(__name__)
WAIT_S = 0.05           # how often a shipped recovery checks whether it is still wanted
RETRY_S = 0.01          # how often an in-flight export or a mid-answer join is tried again


@dataclass
class Resident:
    """What the session's deferred worker keeps of its context, as this worker knows it."""

    actor: str
    epoch: str
    ticket: int
    digest: str
    context: torch.Tensor            # positions of the context rows its last recovery ran on
    adopt: Adopt | None              # the rows of its result that were joined
    adopted: str                     # their fingerprint ("" without)
    turn: TurnStream                 # undone (failed, or abandoned before its end was read) -> the copy is void

    def held(self) -> torch.Tensor:
        if self.adopt is None:
            return self.context
        return torch.cat([self.context, torch.from_numpy(self.adopt.positions)])


@dataclass
class RecoveryReport:
    """One recovery as this backend saw it (`DisaggregatedRecovery.on_report`)."""

    session_id: str
    ticket: int
    actor: str                       # the deferred worker that ran it
    context: int                     # context rows the residual saw
    context_shipped: int             # of those, shipped (all, unless its actor held the rest)
    rows: int                        # deferred rows shipped
    joined: int                      # of those, joined from the result (the rest were fused meanwhile)
    bytes_out: int
    bytes_back: int
    resident: bool                   # shipped only what the actor lacked
    misses: int                      # resident-context misses before it (each then shipped in full)
    latency_s: float                 # answer end -> joined (0 when joined before the answer ended)
    wait_s: float                    # queued for a free deferred worker
    compute_s: float                 # the actor's prefill


@dataclass(eq=False)
class _Job:
    """One turn's residual, from its admission until it is joined (here or by the engine)."""

    ws: WorkerSession
    ticket: int
    turn: TurnStream
    started: bool = False
    local: bool = False              # the engine finishes it (taken back, or done by the next turn's barrier)
    shipped: int = 0                 # bytes sent
    t_answer_end: float | None = None

    def current(self) -> bool:
        """Still this backend's to finish (a hint: the engine's verbs check it exactly)."""
        status = self.ws.session.status()
        return (not status.closed and status.recovery_ticket == self.ticket
                and self.ws.session.engine.turn_error(self.turn) is None)

    def finished(self) -> bool:
        """The engine has no recovery of this turn any more (joined, finished locally, undone, closed)."""
        return not self.current()


class DisaggregatedRecovery(RecoveryBackend):
    mode = "disaggregated"

    def __init__(self, bridge: RayBridge, settings: DeferredSettings, worker_id: str = "", max_in_flight: int = 32):
        self.bridge = bridge
        self.timeout_s = settings.timeout_s
        self.in_flight = settings.ship == "input_done"
        self.fuse = settings.fuse_shipped or not self.in_flight
        self.resident_on = settings.resident_mib > 0
        self.worker_id = worker_id
        self.on_report: Callable[[RecoveryReport], None] = lambda report: None
        bridge.on_queue = lambda depth: DEFERRED_QUEUE.labels(worker_id).set(depth)
        self._executor = ThreadPoolExecutor(max_in_flight, thread_name_prefix="raincheck-deferred")
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}            # session id -> its turn's residual
        self._resident: dict[str, Resident] = {}     # session id -> its deferred worker's copy
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
        """Keep the engine's gap recovery off this turn's residual (and, in flight without `fuse_shipped`,
        fused chunks too); in flight, ship it as soon as the turn's input is in. The hold happens right after
        admission: only a turn that ends within a step or two can lose that race, and then some of its rows
        are simply recovered locally first. Without Ray nothing is held: the engine recovers the turn as
        colocated would."""
        if not self.bridge.connected:
            return
        ticket = ws.session.engine.hold_residual(ws.session, fuse=self.fuse)
        if ticket is None:
            return
        job = _Job(ws, ticket, ws.stream, started=self.in_flight)
        with self._lock:
            self._jobs[ws.id] = job
        if self.in_flight:
            self._executor.submit(self._run, job)

    def answer_done(self, ws: WorkerSession) -> None:
        with self._lock:
            job = self._jobs.get(ws.id)
            if job is None or job.t_answer_end is not None:
                return
            job.t_answer_end = time.perf_counter()
            start, job.started = not job.started, True
        if start:
            self._executor.submit(self._run, job)

    def forget(self, ws: WorkerSession) -> None:
        with self._lock:
            self._jobs.pop(ws.id, None)
            resident = self._resident.pop(ws.id, None)
        if resident is not None:
            self.bridge.forget(ws.id, resident.actor)

    def poll(self) -> None:
        """Ship the residuals of turns that ended without `answer_done` (abandoned or failed streams), drop
        those of turns that have none left, and observe the recoveries the engine finished after a take-back."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.finished():
                with self._lock:
                    if self._jobs.get(job.ws.id) is job:
                        del self._jobs[job.ws.id]
                if job.local:
                    self._observe(job.ws, job.shipped)
            elif not job.started and job.ws.session.status().recovering and not job.ws.active:
                self.answer_done(job.ws)

    # ---------------------------------------------------------------- one recovery
    def _run(self, job: _Job) -> None:
        ws, engine = job.ws, job.ws.session.engine
        slog = bind(log, session_id=ws.id)
        try:
            shipment = self._ship(job)
            if shipment is None:
                self._take_back(job)
                self._local_first(job)
                return
            payload, request, reply, misses = shipment
            result = unpack(ResidualResult, reply.result, engine.device)
            joined = self._join(job, result)
        except Exception as e:   # the deferred worker failed: finish here (a recovery is never lost)
            reason = "timeout" if isinstance(e, TimeoutError) else e.reason if isinstance(e, DeferredWorkerError) \
                else "error"
            slog.warning("deferred worker failed (%s: %s); recovering %d tokens locally", reason, e,
                         ws.session.pending_deferred)
            RECOVERY_FALLBACKS.labels(reason).inc()
            with self._lock:
                self._resident.pop(ws.id, None)
            self._take_back(job)
            return
        self._remember(job, payload, request, reply, joined)
        if joined is None:      # finished locally first (a racing barrier, fused chunks), or no longer wanted
            job.local = True
            self._local_first(job)
            return
        back = result.nbytes()
        latency = ws.session.status().last_recovery_s or 0.0      # answer end -> joined (0: joined mid-answer)
        slog.info("%d deferred tokens recovered on a deferred worker in %.3fs (%.3fs of it prefill; %d bytes "
                  "shipped out, %d back%s)", result.rows - joined.offset, latency, reply.compute_s, job.shipped,
                  back, "; resident context" if request.base is not None else "")
        with self._lock:
            if self._jobs.get(ws.id) is job:
                del self._jobs[ws.id]
        RECOVERY_LATENCY.labels(self.mode).observe(latency)
        RECOVERY_BYTES.labels(self.mode).observe(job.shipped + back)
        self.on_report(RecoveryReport(ws.id, job.ticket, reply.actor, payload.visible, len(payload.context_index),
                                      payload.rows, result.rows - joined.offset, job.shipped,
                                      back, request.base is not None, misses, latency, reply.wait_s,
                                      reply.compute_s))

    def _ship(self, job: _Job) -> tuple[ResidualPayload, PrefillRequest, PrefillReply, int] | None:
        """Export (once the turn's input is in), send, and get the reply; a resident-context miss sends the
        whole context again. None once the recovery is no longer this backend's."""
        ws, engine = job.ws, job.ws.session.engine
        while not engine.input_prefilled(job.turn):  # in flight: the input is still being prefilled
            if self._stopping.is_set() or not job.current():
                return None
            time.sleep(RETRY_S)
        misses = 0
        with self._lock:
            resident = self._resident.get(ws.id) if self.resident_on else None
        if resident is not None and engine.turn_error(resident.turn) is not None:
            resident = None                          # its copy includes a turn that was undone
        while True:
            try:
                payload = ws.session.engine.export_residual(ws.session, job.ticket,
                                                            resident.held() if resident else None)
            except RecoveryStateError:   # the next turn's barrier took it first, or the session closed
                return None
            request = self._request(job, payload, resident)
            job.shipped = payload.nbytes()
            bind(log, session_id=ws.id).info("shipping %d deferred tokens to a deferred worker (%d bytes%s)",
                                             payload.rows, job.shipped, "; resident context" if resident else "")
            try:
                reply = self._remote(job, resident.actor if resident else None, request)
            except DeferredWorkerError as e:   # the actor holding the session's context died: ship it all elsewhere
                if resident is None or e.reason != "worker_died":
                    raise
                reply = PrefillReply(miss="gone")
            if reply is None:
                return None
            if reply.miss is None:
                return payload, request, reply, misses
            if resident is None:
                raise DeferredWorkerError("error", f"a full shipment was answered with a miss: {reply.miss}")
            RESIDENT_MISSES.labels(reply.miss).inc()
            bind(log, session_id=ws.id).info("resident context missed (%s): shipping the whole context",
                                             reply.miss)
            misses += 1
            resident = None
            with self._lock:
                self._resident.pop(ws.id, None)

    def _request(self, job: _Job, payload: ResidualPayload, resident: Resident | None) -> PrefillRequest:
        """The whole context under a new lineage, or (`resident`) only what the actor lacks, on its copy."""
        if resident is None:
            return PrefillRequest(job.ws.id, job.ticket, pack(payload), uuid.uuid4().hex[:12], self.resident_on)
        return PrefillRequest(job.ws.id, job.ticket, pack(payload), resident.epoch, self.resident_on,
                              Base(resident.epoch, resident.digest), resident.adopt)

    def _remote(self, job: _Job, actor: str | None, request: PrefillRequest) -> PrefillReply | None:
        """The actor's reply; None once the recovery is no longer this backend's or the worker stops.
        TimeoutError past the deadline (from the answer's end); DeferredWorkerError when the deferred
        workers fail it."""
        future = self.bridge.prefill(job.ws.id, actor, request)
        while True:
            try:
                reply = future.result(timeout=WAIT_S)
                break
            except FutureTimeout:
                pass
            if self._stopping.is_set() or not job.current():
                self.bridge.cancel(future)
                return None
            if job.t_answer_end is not None and time.perf_counter() > job.t_answer_end + self.timeout_s:
                self.bridge.cancel(future)
                raise TimeoutError(f"no result within {self.timeout_s:g}s of the answer's end")
        DEFERRED_QUEUE_WAIT.observe(reply.wait_s)
        return reply

    def _join(self, job: _Job, result: ResidualResult) -> Joined | None:
        """Join as soon as the engine lets it (mid-answer only where a fused chunk could join). None when
        the recovery is no longer there to join (finished locally, the turn undone, the session closed)."""
        engine, session = job.ws.session.engine, job.ws.session
        while True:
            try:
                joined = engine.apply_residual(session, job.ticket, result)
            except RecoveryStateError:
                return None
            if joined is not None:
                return joined
            if self._stopping.is_set() or not job.current():
                return None
            time.sleep(RETRY_S)

    def _remember(self, job: _Job, payload: ResidualPayload, request: PrefillRequest, reply: PrefillReply,
                  joined: Joined | None) -> None:
        """What the actor keeps now (if it kept anything): its digest, computed here as it was there."""
        ws = job.ws
        if not (self.resident_on and reply.kept) or ws.session.closed:
            with self._lock:
                self._resident.pop(ws.id, None)
            return
        with self._lock:
            previous = self._resident.get(ws.id) if request.base is not None else None
        adopted = "" if previous is None else previous.adopted
        digest = chain(previous.digest if previous else "", job.ticket, adopted,
                       shipped_fingerprint(request.payload))
        if digest != reply.digest:
            bind(log, session_id=ws.id).warning("the deferred worker's copy differs from what was shipped: not used")
            with self._lock:
                self._resident.pop(ws.id, None)
            return
        context = payload.context_index if previous is None else torch.cat([previous.held(), payload.context_index])
        adopt, adopted = None, ""
        if joined is not None:
            adopt = Adopt(joined.offset, joined.positions.numpy())
            adopted = adopted_fingerprint(reply.result, adopt.offset, adopt.positions)
        with self._lock:
            self._resident[ws.id] = Resident(reply.actor, request.epoch, job.ticket, digest, context, adopt, adopted,
                                             job.turn)

    def _local_first(self, job: _Job) -> None:
        if not (job.ws.session.closed or job.ws.session.engine.turn_error(job.turn) is not None
                or self._stopping.is_set()):
            bind(log, session_id=job.ws.id).info("the residual was recovered locally first (fused chunks, or the "
                                                 "next turn's barrier)")

    def _take_back(self, job: _Job) -> None:
        """The engine finishes this residual (or has finished it): `poll` observes it when done."""
        job.ws.session.engine.take_back(job.ws.session, job.ticket)
        job.local = True

    def _observe(self, ws: WorkerSession, nbytes: int) -> None:
        RECOVERY_LATENCY.labels(self.mode).observe(ws.session.status().last_recovery_s or 0.0)
        RECOVERY_BYTES.labels(self.mode).observe(nbytes)
