"""The deferred-worker actors one decode worker ships residuals to, as its Ray driver process sees them
(driver.py runs this, and every Ray call of it, in one thread).

Actors: those registered by name in the namespace for the model (`raincheck deferred-worker`), or,
while there are none, actors of the pool's own (`settings.workers` of them, more while residuals wait,
up to `settings.max_workers`; an own actor beyond `workers` that has been idle `settings.idle_s` is
stopped). Each actor runs one residual at a time: a job waits in the pool's queue until its actor is
free, and the queue is what grows the pool (an actor asks Ray for a resource shape that the Ray
autoscaler, and KubeRay's, turn into a node or pod when none has room).

A job names the actor its payload was made for (the actor that holds the session's resident context)
or none. A named actor that is gone, or still busy after `AFFINITY_WAIT_S` while another is free, gets
the job answered with a miss: the decode worker then ships the full context to whichever actor is free.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..common.settings import DeferredSettings, ModelSpec
from .actor import connect, own_prefix, registered, start_actor

log = logging.getLogger(__name__)
REFRESH_S = 10.0         # how often the registered actors are listed again
AFFINITY_WAIT_S = 2.0    # a job for a busy actor waits this long before it may go elsewhere (as a miss)
WAIT_S = 0.02            # longest ray.wait of one loop turn


class ActorLost(Exception):
    pass


@dataclass(eq=False)
class Job:
    id: int
    session: str
    actor: str | None                 # the actor holding the session's resident context, if the payload relies on it
    request: dict                     # a PrefillRequest as plain data (messages.py), for the actor
    received: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Actor:
    key: str
    handle: ray.actor.ActorHandle
    own: bool
    ready: ray.ObjectRef | None = None     # set until the actor has loaded its checkpoint
    job: Job | None = None
    ref: ray.ObjectRef | None = None
    dispatched: float = 0.0
    idle_since: float = field(default_factory=time.monotonic)
    calls: int = 0

    @property
    def free(self) -> bool:
        return self.ready is None and self.job is None


class DeferredPool:
    def __init__(self, settings: DeferredSettings, spec: ModelSpec, model: str, reply: Callable[[dict], None]):
        self.settings = settings
        self.spec = spec
        self.model = model
        self.reply = reply               # sends a message back to the decode worker
        self.actors: dict[str, _Actor] = {}
        self.queue: list[Job] = []
        self._listed = float("-inf")
        self._depth = 0

    # ---------------------------------------------------------------- lifecycle
    def attach(self) -> None:
        """Connect to Ray and find or start the actors (raises when Ray cannot be reached)."""
        connect(self.settings, self.settings.most_workers)
        self._refresh()
        log.info("deferred workers for %s: %d (%s)", self.model, len(self.actors),
                 "registered" if self.registered_actors() else "own")

    def stop(self) -> None:
        for actor in self.actors.values():
            if actor.own:
                ray.kill(actor.handle)
        self.actors.clear()

    # ---------------------------------------------------------------- jobs
    def submit(self, job: Job) -> None:
        self.queue.append(job)

    def forget(self, session: str, actor: str | None) -> None:
        """The session closed: its actor drops its resident context."""
        target = self.actors.get(actor) if actor else None
        if target is not None:
            target.handle.forget.remote(session)

    def cancel(self, job_id: int) -> None:
        """The decode worker no longer wants this job: drop it if it has not started."""
        self.queue = [j for j in self.queue if j.id != job_id]

    def turn(self) -> bool:
        """One round: refresh, dispatch what can run, collect what finished, resize. True if anything moved."""
        now = time.monotonic()
        if now - self._listed > REFRESH_S or not self.actors:
            self._refresh()
        moved = self._collect_ready()
        moved |= self._dispatch(now)
        moved |= self._collect(WAIT_S if self._busy() else 0.0)
        self._resize(time.monotonic())
        depth = len(self.queue)
        if depth != self._depth:
            self._depth = depth
            self.reply({"op": "queue", "depth": depth})
        return moved

    def probe(self) -> None:
        """Ask the GCS something: blocks (and the driver's watchdog ends the process) once Ray is gone."""
        ray.available_resources()

    def idle(self) -> bool:
        return not self.queue and not self._busy()

    def stats(self) -> dict:
        actors = [a for a in self.actors.values() if a.ready is None]
        details = ray.get([a.handle.stats.remote() for a in actors], timeout=30) if actors else []
        return {"queued": len(self.queue), "registered": self.registered_actors(),
                "actors": [{"key": a.key, "own": a.own, "busy": a.job is not None, **d}
                           for a, d in zip(actors, details, strict=True)]}

    # ---------------------------------------------------------------- inside a round
    def _dispatch(self, now: float) -> bool:
        moved = False
        for job in list(self.queue):
            target = self._target(job, now)
            if target is None:
                continue
            self.queue.remove(job)
            moved = True
            if isinstance(target, str):            # a miss: the decode worker ships the full context elsewhere
                self.reply({"op": "reply", "id": job.id, "ok": True, "miss": target, "wait_s": now - job.received})
                continue
            target.job, target.dispatched = job, now
            target.ref = target.handle.prefill.remote(job.request)
        return moved

    def _target(self, job: Job, now: float) -> _Actor | str | None:
        """The actor to run `job` now, why it is answered with a miss (`gone`, `busy`), or None to keep it
        queued."""
        free = [a for a in self.actors.values() if a.free]
        if job.actor is not None:
            actor = self.actors.get(job.actor)
            if actor is None:
                return "gone"
            if actor.free:
                return actor
            if free and now - job.received > AFFINITY_WAIT_S:
                return "busy"
            return None
        return min(free, key=lambda a: (a.calls, a.key)) if free else None

    def _collect(self, timeout: float) -> bool:
        running = {a.ref: a for a in self.actors.values() if a.ref is not None}
        if not running:
            return False
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout)
        for ref in ready:
            self._finish(running[ref], ref)
        return bool(ready)

    def _finish(self, actor: _Actor, ref: ray.ObjectRef) -> None:
        job = actor.job
        actor.job, actor.ref, actor.idle_since = None, None, time.monotonic()
        actor.calls += 1
        wait_s = actor.dispatched - job.received
        try:
            reply = ray.get(ref)
        except RayActorError as e:
            self._lost(actor)
            self.reply({"op": "reply", "id": job.id, "ok": False, "reason": "worker_died", "message": str(e)[:500],
                        "wait_s": wait_s})
            return
        except RayTaskError as e:     # the actor's prefill raised
            self.reply({"op": "reply", "id": job.id, "ok": False, "reason": "error", "message": str(e)[:500],
                        "wait_s": wait_s})
            return
        self.reply({"op": "reply", "id": job.id, "ok": True, "actor": actor.key, "wait_s": wait_s, **reply})

    def _collect_ready(self) -> bool:
        """Actors that finished loading their checkpoint become free (or are dropped if they died)."""
        loading = {a.ready: a for a in self.actors.values() if a.ready is not None}
        if not loading:
            return False
        ready, _ = ray.wait(list(loading), num_returns=len(loading), timeout=0)
        for ref in ready:
            actor = loading[ref]
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError, GetTimeoutError):
                log.exception("deferred worker %s failed to start", actor.key)
                self._lost(actor)
                continue
            actor.ready, actor.idle_since = None, time.monotonic()
        return bool(ready)

    def _busy(self) -> bool:
        return any(a.ref is not None for a in self.actors.values())

    def _lost(self, actor: _Actor) -> None:
        log.warning("deferred worker %s is gone", actor.key)
        self.actors.pop(actor.key, None)
        self._listed = float("-inf")

    # ---------------------------------------------------------------- which actors
    def registered_actors(self) -> bool:
        """The pool uses actors registered in the namespace (not its own)."""
        return any(not a.own for a in self.actors.values())

    def _refresh(self) -> None:
        self._listed = time.monotonic()
        named = registered(self.settings, self.model)
        if named:
            for name, handle in named.items():
                if name not in self.actors:
                    self.actors[name] = _Actor(name, handle, own=False)
            for key in [k for k, a in self.actors.items() if not a.own and k not in named]:
                del self.actors[key]
            for key in [k for k, a in self.actors.items() if a.own and a.job is None]:
                ray.kill(self.actors.pop(key).handle)      # registered ones take over
            return
        while sum(a.own for a in self.actors.values()) < self.settings.workers:
            self._start_own()

    def _start_own(self) -> None:
        key = f"{own_prefix(self.model)}{uuid.uuid4().hex[:8]}"
        handle = start_actor(self.settings, self.spec, name=key)
        self.actors[key] = _Actor(key, handle, own=True, ready=handle.ready.remote())
        log.info("started deferred worker %s (%d own)", key, sum(a.own for a in self.actors.values()))

    def _resize(self, now: float) -> None:
        """Grow while a job has waited `scale_up_wait_s` and every actor is busy or loading; stop own actors
        beyond `workers` that have been idle `idle_s`. Registered actors are their keeper's to size."""
        if self.registered_actors():
            return
        own = [a for a in self.actors.values() if a.own]
        waited = self.queue and now - self.queue[0].received > self.settings.scale_up_wait_s
        if waited and not any(a.free for a in own) and not any(a.ready is not None for a in own) \
                and len(own) < self.settings.most_workers:
            self._start_own()
            return
        extra = len(own) - self.settings.workers
        for actor in sorted(own, key=lambda a: a.idle_since):
            if extra <= 0:
                break
            if actor.free and now - actor.idle_since > self.settings.idle_s:
                log.info("stopping idle deferred worker %s", actor.key)
                self.actors.pop(actor.key)
                ray.kill(actor.handle)
                extra -= 1
