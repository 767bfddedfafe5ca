"""A decode worker process: the DecodeWorker gRPC server, its Engine, and its registration in the store."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

from grpc_health.v1 import health_pb2

from raincheck_core.warmup import warm_up

from .._gen import worker_pb2, worker_pb2_grpc
from ..common import gc_freeze, native_heap
from ..common.grpc_util import add_health_and_reflection, bind, make_server
from ..common.metrics import RECOVERY_UP
from ..common.model_loading import load_engine, model_name
from ..common.settings import WorkerSettings
from ..common.store import Store, WorkerInfo
from .recovery import RecoveryBackend
from .runtime import WorkerRuntime
from .servicer import DecodeWorkerServicer

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
RECOVERY_HEALTH = "raincheck.recovery."     # + mode: a health service per recovery mode


def recovery_backends(settings: WorkerSettings, model: str, worker_id: str) -> list[RecoveryBackend]:
    """The backends besides colocated that `settings.recovery_modes` asks for."""
    if "disaggregated" not in settings.recovery_modes:
        return []
    from ..deferred_worker.bridge import RayBridge
    from .disaggregated_recovery import DisaggregatedRecovery

    bridge = RayBridge(settings.deferred, settings.model_spec(), model)
    return [DisaggregatedRecovery(bridge, settings.deferred, worker_id)]


class DecodeWorkerServer:
    """`backends`: recovery backends besides colocated offered to sessions (default: what
    `settings.recovery_modes` asks for)."""

    def __init__(self, settings: WorkerSettings, store: Store, backends: list[RecoveryBackend] | None = None):
        self.settings = settings
        self.store = store
        spec = settings.model_spec()
        engine, self.model = load_engine(spec), model_name(spec)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()       # when its model loaded (OpenAI's `created` of the model)
        if backends is None:
            backends = recovery_backends(settings, self.model, self.worker_id)
        self.runtime = WorkerRuntime(engine, settings, self.worker_id, backends)
        self.runtime.on_change = self.register
        self.runtime.on_rank_failure = self._rank_failed
        self.server = make_server(settings.threads, settings.max_message_bytes)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(self.runtime), self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        for mode, backend in self.runtime.backends.items():
            self._recovery_health(mode, mode == "colocated")
            backend.watch(lambda up, mode=mode: self._recovery_health(mode, up))
        self.port = bind(self.server, settings.host, settings.port)
        self.address = settings.advertise or f"{settings.host}:{self.port}"
        self._stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="raincheck-heartbeat", daemon=True)

    def _recovery_health(self, mode: str, up: bool) -> None:
        """Health service `raincheck.recovery.<mode>` and `raincheck:recovery_mode_up`: NOT_SERVING / 0 while
        the mode is degraded. The worker itself keeps serving (its overall health is unaffected)."""
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(f"{RECOVERY_HEALTH}{mode}", status)
        RECOVERY_UP.labels(self.worker_id, mode).set(int(up))

    def info(self) -> WorkerInfo:
        stats = self.runtime.stats()
        return WorkerInfo(self.worker_id, self.address, self.model, list(self.runtime.backends),
                          sessions=stats.sessions, active_turns=stats.active_turns, free_pages=stats.free_pages,
                          total_pages=stats.total_pages, started_at=self.started_at)

    def register(self) -> None:
        """Create or refresh this worker's registration, with its current load."""
        if self._stopping.is_set() or self.runtime.rank_failure is not None:
            return
        try:
            self.store.register_worker(self.info(), self.settings.registration_ttl_s)
        except Exception:   # the store may be briefly unreachable: keep serving, retry at the next beat
            log.exception("cannot register worker %s", self.worker_id, extra={"worker_id": self.worker_id})

    def _rank_failed(self, why: str) -> None:
        """A tensor-parallel rank of the engine died or stopped answering: health NOT_SERVING and out of
        the registry (frontends route elsewhere; its turns fail with RankFailedError, UNAVAILABLE), its
        sessions marked for takeover, and a new engine started with new ranks (`_restart`)."""
        log.error("engine ranks failed, not serving: %s", why, extra={"worker_id": self.worker_id})
        self.health.set_ready(False)
        try:
            self.store.remove_worker(self.worker_id)
        except Exception:   # the registration lapses by itself
            log.exception("cannot deregister worker %s", self.worker_id, extra={"worker_id": self.worker_id})
        if not self._stopping.is_set():
            threading.Thread(target=self._restart, name="raincheck-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        """Load the model again (its ranks started afresh), warm it up, and serve: SERVING and registered."""
        self._detach_sessions()
        try:
            engine = self.runtime.replace_engine(lambda: load_engine(self.settings.model_spec()))
            warm_up(engine, calibrate=self.settings.calibrate)
        except Exception:   # stays NOT_SERVING: the pod's restart (or an operator) takes over
            log.exception("cannot restart the engine", extra={"worker_id": self.worker_id})
            return
        gc_freeze.refreeze()     # the old engine's objects were frozen with the first one's
        if self._stopping.is_set():
            return
        self.health.set_ready(True)
        self.register()
        log.info("engine restarted: serving again", extra={"worker_id": self.worker_id})

    def _beat(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            self.register()
            self.runtime.reap_idle()
            native_heap.trim()

    def start(self) -> DecodeWorkerServer:
        """Serve: health NOT_SERVING (the port answers) until a warm-up turn has run through the loaded
        model; then SERVING and registered, so frontends route to it only from then on."""
        self.runtime.start()     # first: a local Ray forks its processes before gRPC's threads run
        self.server.start()
        report = warm_up(self.runtime.engine, calibrate=self.settings.calibrate)
        log.info("warm-up: %d steps in %.2fs, %d chunk buckets measured", report.steps, report.seconds,
                 report.chunk_buckets, extra={"worker_id": self.worker_id})
        self.health.set_ready(True)
        self.register()
        self._heartbeat.start()
        log.info("decode worker %s serving %s at %s", self.worker_id, self.model, self.address,
                 extra={"worker_id": self.worker_id, "service": "decode_worker"})
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Drain (SIGTERM): health NOT_SERVING and out of the registry; new sessions and turns are
        refused (UNAVAILABLE: the frontend rebuilds the session elsewhere); the running turns (with the
        recoveries they follow) and the pending recoveries get `grace_s` to finish. Then every session is
        marked for takeover in the store (the frontend rebuilds it on another worker from its turn log at
        its next turn), what still runs is cancelled, and the sessions are closed here. The port stays
        open until then, so TCP liveness probes pass while draining."""
        deadline = time.monotonic() + grace_s
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.store.remove_worker(self.worker_id)
        self.runtime.drain(grace_s)
        self._detach_sessions()
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        self.runtime.stop()
        for mode in self.runtime.backends:
            RECOVERY_UP.remove(self.worker_id, mode)
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5)

    def _detach_sessions(self) -> None:
        detached = 0
        for session_id in list(self.runtime.sessions):
            try:
                detached += self.store.detach_session(session_id, self.worker_id)
            except Exception:   # the store is unreachable: the registration lapses, and frontends rebuild anyway
                log.exception("cannot mark session %s for takeover", session_id, extra={"worker_id": self.worker_id})
        log.info("stopped; %d sessions marked for takeover", detached, extra={"worker_id": self.worker_id})
