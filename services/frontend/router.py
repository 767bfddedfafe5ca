"""Which decode worker serves a session: least-loaded healthy worker for a new one, the owner after."""

from __future__ import annotations

import threading
import time

from .._gen import worker_pb2_grpc
from ..common.grpc_util import ServiceError, channel
from ..common.store import Store, WorkerInfo

# A worker that failed a call is passed over this long: about its registration's TTL, so that a worker
# that died is not picked again while its registration lapses.
SUSPECT_S = 10.0


class Router:
    def __init__(self, store: Store, max_message_bytes: int):
        self.store = store
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}
        self._channels = []
        self._lock = threading.Lock()
        self._suspects: dict[str, float] = {}   # worker id -> until when it is passed over

    def failed(self, worker_id: str) -> None:
        """`worker_id` could not be reached (or refused as draining): pass it over for SUSPECT_S."""
        with self._lock:
            self._suspects[worker_id] = time.monotonic() + SUSPECT_S

    def _suspect(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            self._suspects = {w: until for w, until in self._suspects.items() if until > now}
            return frozenset(self._suspects)

    def pick(self, model: str, mode: str, exclude: frozenset[str] = frozenset()) -> WorkerInfo:
        """The least-loaded live worker serving `model` ("" = any) with `mode` recovery; one that failed a
        call lately only when no other will do."""
        live = [w for w in self.store.workers() if w.worker_id not in exclude]
        if not live:
            raise ServiceError.unavailable("no healthy decode worker is registered")
        serving = [w for w in live if not model or w.model == model]
        if not serving:
            names = ", ".join(sorted({w.model for w in live}))
            raise ServiceError.not_found(f"no healthy decode worker serves model {model!r} (served: {names})")
        offering = [w for w in serving if mode in w.recovery_modes]
        if not offering:
            raise ServiceError.failed_precondition(f"no healthy decode worker serving {serving[0].model!r} "
                                                   f"offers {mode} recovery")
        suspect = self._suspect()
        trusted = [w for w in offering if w.worker_id not in suspect]
        return min(trusted or offering, key=lambda w: (w.sessions, w.active_turns, -w.free_pages, w.worker_id))

    def owner(self, worker_id: str) -> WorkerInfo | None:
        """The session's worker if it is still registered (None for a session marked for takeover)."""
        return self.store.worker(worker_id) if worker_id else None

    def stub(self, worker: WorkerInfo) -> worker_pb2_grpc.DecodeWorkerStub:
        with self._lock:
            stub = self._stubs.get(worker.address)
            if stub is None:
                ch = channel(worker.address, self.max_message_bytes)
                self._channels.append(ch)
                stub = self._stubs[worker.address] = worker_pb2_grpc.DecodeWorkerStub(ch)
            return stub

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()
