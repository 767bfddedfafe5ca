"""`raincheck deferred-worker`: keeps N named deferred-worker actors alive in a Ray namespace, where
decode workers find them by name (`actor.registered`)."""

from __future__ import annotations

import logging
import threading

import ray

from ..common.model_loading import model_name
from ..common.settings import DeferredSettings, ModelSpec
from .actor import actor_prefix, connect, start_actor

log = logging.getLogger(__name__)


class Keeper:
    """Detached actors `deferred:<model>:0..N-1`. Ray restarts one whose process dies; one that is gone
    (killed, or its node lost) is started again at the next check. `stop` kills them."""

    def __init__(self, settings: DeferredSettings, spec: ModelSpec, check_s: float = 5.0):
        self.settings = settings
        self.spec = spec
        self.check_s = check_s
        self.names = [f"{actor_prefix(model_name(spec))}{i}" for i in range(settings.workers)]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raincheck-deferred-keeper", daemon=True)
        self._connected = False

    def start(self) -> Keeper:
        self._connected = connect(self.settings, self.settings.workers)
        self._ensure()
        self._thread.start()
        return self

    def address(self) -> str:
        """Where decode workers attach (RAY_ADDRESS)."""
        return self.settings.ray_address or ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        for name in self.names:
            try:
                ray.kill(ray.get_actor(name, namespace=self.settings.namespace))
            except ValueError:   # already gone
                continue
        if self._connected:
            ray.shutdown()

    def _ensure(self) -> None:
        for name in self.names:
            start_actor(self.settings, self.spec, name=name, lifetime="detached", get_if_exists=True,
                        max_restarts=-1)

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_s):
            try:
                self._ensure()
            except Exception:   # Ray briefly unreachable: try again at the next check
                log.exception("cannot check the deferred workers")
