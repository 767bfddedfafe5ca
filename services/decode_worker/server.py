"""A decode worker process: the DecodeWorker gRPC server, its Engine, and its registration in the store."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import uuid
from pathlib import Path

from raincheck_client._gen import worker_pb2, worker_pb2_grpc
from raincheck_core import Engine

from ..common.grpc_util import add_health_and_reflection, bind, make_server
from ..common.settings import WorkerSettings
from ..common.store import Store, WorkerInfo
from .recovery import RecoveryBackend
from .runtime import WorkerRuntime
from .servicer import DecodeWorkerServicer

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def load_engine(settings: WorkerSettings) -> tuple[Engine, str]:
    """The worker's Engine and the model name it registers under."""
    options = dict(device=settings.device, dtype=settings.dtype, **settings.engine)
    if settings.model is not None:
        return Engine.from_pretrained(settings.model, **options), settings.model_name or Path(settings.model).name
    from .random_model import save_random_model

    log.warning("no --model given: serving a RANDOM %s Qwen3.5-architecture model with a character-level "
                "tokenizer (answers are noise; timings are real) until the demo model ships", settings.random_size)
    with tempfile.TemporaryDirectory(prefix="raincheck-random-") as folder:
        engine = Engine.from_pretrained(save_random_model(folder, settings.random_size), **options)
    return engine, settings.model_name or f"random-{settings.random_size}"


class DecodeWorkerServer:
    """`backends`: recovery backends besides colocated (e.g. disaggregated), offered to sessions."""

    def __init__(self, settings: WorkerSettings, store: Store, backends: list[RecoveryBackend] | None = None):
        self.settings = settings
        self.store = store
        engine, self.model = load_engine(settings)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.runtime = WorkerRuntime(engine, settings, self.worker_id, backends)
        self.runtime.on_change = self.register
        self.server = make_server(settings.threads, settings.max_message_bytes)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(self.runtime), self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = bind(self.server, settings.host, settings.port)
        self.address = settings.advertise or f"{settings.host}:{self.port}"
        self._stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="raincheck-heartbeat", daemon=True)

    def info(self) -> WorkerInfo:
        stats = self.runtime.stats()
        return WorkerInfo(self.worker_id, self.address, self.model, list(self.runtime.backends),
                          sessions=stats.sessions, active_turns=stats.active_turns, free_pages=stats.free_pages,
                          total_pages=stats.total_pages)

    def register(self) -> None:
        """Create or refresh this worker's registration, with its current load."""
        if self._stopping.is_set():
            return
        try:
            self.store.register_worker(self.info(), self.settings.registration_ttl_s)
        except Exception:   # the store may be briefly unreachable: keep serving, retry at the next beat
            log.exception("cannot register worker %s", self.worker_id, extra={"worker_id": self.worker_id})

    def _beat(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            self.register()
            self.runtime.reap_idle()

    def start(self) -> DecodeWorkerServer:
        self.server.start()
        self.runtime.start()
        self.register()
        self._heartbeat.start()
        log.info("decode worker %s serving %s at %s", self.worker_id, self.model, self.address,
                 extra={"worker_id": self.worker_id, "service": "decode_worker"})
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Deregister, finish (or cancel after `grace_s`) the running RPCs, close every session."""
        self._stopping.set()
        self.store.remove_worker(self.worker_id)
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self.runtime.stop()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5)
