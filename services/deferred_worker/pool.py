"""The deferred workers a decode worker ships residuals to."""

from __future__ import annotations

import logging
import threading
import time

import ray

from ..common.settings import DeferredSettings, ModelSpec
from .actor import connect, registered, start_actor

log = logging.getLogger(__name__)
REFRESH_S = 10.0        # how often the registered actors are listed again (and an unreachable Ray retried)


class NoDeferredWorkerError(RuntimeError):
    pass


class DeferredPool:
    """The actors registered by name in the namespace for this model (`raincheck deferred-worker`), or,
    while there are none, `settings.workers` actors of its own (they end with this process's Ray
    connection). Round-robin; an actor that died is dropped at once.

    Ray is attached by a thread of the pool's own, which lives as long as the pool: a local Ray's
    processes die with the thread that started them (Ray sets PR_SET_PDEATHSIG). `start` waits up to
    `attach_wait_s` for it, then the worker serves anyway; until Ray is reached `pick` raises (the
    decode worker recovers locally), and the thread keeps trying."""

    def __init__(self, settings: DeferredSettings, spec: ModelSpec, model: str, attach_wait_s: float = 60.0):
        self.settings = settings
        self.spec = spec
        self.model = model
        self.attach_wait_s = attach_wait_s
        self._lock = threading.Lock()
        self._registered: list[ray.actor.ActorHandle] = []
        self._own: list[ray.actor.ActorHandle] = []
        self._next = 0
        self._listed = float("-inf")
        self._attached = threading.Event()
        self._owns_connection = False   # this pool connected, so it disconnects at its end
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raincheck-ray", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._attached.wait(self.attach_wait_s):
            log.warning("Ray not reached within %gs: serving anyway, disaggregated recoveries finish locally "
                        "until it is", self.attach_wait_s)

    def pick(self) -> ray.actor.ActorHandle:
        if not self._attached.is_set():
            raise NoDeferredWorkerError("not connected to Ray (yet)")
        with self._lock:
            if time.monotonic() - self._listed > REFRESH_S or not self._current():
                self._refresh()
            actors = self._current()
            if not actors:
                raise NoDeferredWorkerError(f"no deferred worker for {self.model}")
            self._next += 1
            return actors[self._next % len(actors)]

    def lost(self, actor: ray.actor.ActorHandle) -> None:
        """`actor` died: stop using it (an own actor is replaced at the next pick)."""
        with self._lock:
            self._registered = [a for a in self._registered if a != actor]
            self._own = [a for a in self._own if a != actor]
            self._listed = float("-inf")

    def actors(self) -> list[ray.actor.ActorHandle]:
        with self._lock:
            return list(self._current())

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)   # still blocked in Ray if it never got through: left behind (daemon)

    def _run(self) -> None:
        if not self._attach():
            return
        self._stopping.wait()
        with self._lock:
            own, self._own = self._own, []
        for actor in own:
            ray.kill(actor)
        if self._owns_connection:
            ray.shutdown()

    def _attach(self) -> bool:
        while not self._stopping.is_set():
            try:
                owns = connect(self.settings, self.settings.workers)
                with self._lock:
                    self._owns_connection = owns
                    self._refresh()
                    found, own = len(self._registered), len(self._own)
            except Exception:
                log.exception("cannot reach Ray (trying again in %gs)", REFRESH_S)
                self._stopping.wait(REFRESH_S)
                continue
            self._attached.set()
            log.info("deferred workers for %s: %d registered, %d of its own", self.model, found, own)
            return True
        return False

    def _current(self) -> list[ray.actor.ActorHandle]:
        return self._registered or self._own

    def _refresh(self) -> None:
        self._listed = time.monotonic()
        self._registered = registered(self.settings, self.model)
        if not self._registered:
            self._own += [start_actor(self.settings, self.spec) for _ in range(self.settings.workers - len(self._own))]
