"""A frontend is ready while it can route a turn: at least one live decode worker is registered.

Health starts NOT_SERVING, becomes SERVING once a worker has registered (a worker registers only after its
model has loaded and its warm-up ran) and goes back to NOT_SERVING when the last one has left or lapsed.
A probe's Check reads the store there and then; a thread refreshes the status every `interval_s` for Watch
streams. Liveness is another matter (is the process up): the k8s manifests probe the port for it.
"""

from __future__ import annotations

import logging
import threading

from ..common.grpc_util import ReadinessHealth
from ..common.store import Store

log = logging.getLogger(__name__)
INTERVAL_S = 0.5


class Readiness:
    def __init__(self, store: Store, interval_s: float = INTERVAL_S):
        self.store = store
        self.interval_s = interval_s
        self.health: ReadinessHealth | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raincheck-readiness", daemon=True)

    def ready(self) -> bool:
        try:
            return bool(self.store.workers())
        except Exception:   # the store is unreachable: nothing can be routed
            log.warning("cannot read the worker registry", exc_info=True)
            return False

    def refresh(self) -> None:
        if self.health is not None:
            self.health.set_ready(self.ready())

    def start(self, health: ReadinessHealth) -> None:
        self.health = health
        self.refresh()
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
