"""The deferred-worker Ray actor, and how to reach Ray and name, find and start such actors.

A `DeferredWorker` holds one Engine on the decode workers' checkpoint and prefills the residuals they
ship (`Engine.prefill_residual`). Payloads and results cross Ray's object store as numpy arrays
(wire.py): Ray deserializes them zero-copy, and the actor never unpickles a torch tensor. Ray itself
pickles what it carries, so the cluster must be trusted (it is Raincheck's own). This module imports
neither torch nor the engine at the top: the decode worker's Ray driver process (driver.py) only names
the class; the actor's own process loads them.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from ..common.settings import DeferredSettings, MiB, ModelSpec

log = logging.getLogger(__name__)


class DeferredWorker:
    """Ray actor class (wrapped with `ray.remote` where it is started, with the options it asks for).
    Keeps sessions' contexts between recoveries within `resident_bytes` (resident.py; 0: none)."""

    def __init__(self, spec: ModelSpec, resident_bytes: int = 0):
        from ..common.model_loading import load_engine
        from .resident import ResidentContexts

        self.engine = load_engine(spec)
        self.resident = ResidentContexts(resident_bytes)
        self.calls = 0
        self.misses = 0

    def ready(self) -> int:
        """Answers once the checkpoint has loaded: the actor's process id."""
        return os.getpid()

    def prefill(self, wire: dict) -> dict:
        """A PrefillRequest, as plain data (messages.py): prefill its payload on the context it ships and,
        when it names one (`base`), on the copy of the session's context this actor keeps. Returns the
        PrefillReply as plain data: the packed ResidualResult, the compute time and the digest of the copy
        now kept (`kept`: whether it is; a request without `keep` keeps none), or the miss when the named
        copy is not here."""
        from raincheck_core.deferral.handoff import ResidualPayload

        from .messages import PrefillReply, PrefillRequest
        from .resident import Entry, Miss
        from .wire import pack, unpack

        t0 = time.perf_counter()
        request = PrefillRequest.from_wire(wire)
        payload = unpack(ResidualPayload, request.payload, self.engine.device)
        try:
            full, digest = self.resident.context(request, payload)
        except Miss as e:
            self.resident.forget(request.session)
            self.misses += 1
            return PrefillReply(miss=e.reason).to_wire()
        result = pack(self.engine.prefill_residual(full))
        kept = request.keep and self.resident.budget > 0 and self.resident.keep(
            request.session, Entry(request.epoch, digest, full.context_index, full.context_k, full.context_v, result))
        self.calls += 1
        return PrefillReply(result, time.perf_counter() - t0, digest, kept).to_wire()

    def forget(self, session_id: str) -> None:
        """The session closed: drop its context."""
        self.resident.forget(session_id)

    def stats(self) -> dict[str, int]:
        return {"pid": os.getpid(), "calls": self.calls, "misses": self.misses,
                "resident_sessions": len(self.resident.entries), "resident_bytes": self.resident.nbytes,
                "evictions": self.resident.evictions}


_Remote = ray.remote(DeferredWorker)


def connect(settings: DeferredSettings, local_slots: int) -> bool:
    """Attach to `settings.ray_address` (a cluster, or `ray://` Ray Client), or start a private local Ray
    (on loopback) offering `local_slots` units of the custom resource. True when this call connected,
    so the caller disconnects at its end; False when this process was already connected."""
    if ray.is_initialized():
        return False
    if settings.ray_address:
        log.info("connecting to Ray at %s (namespace %s)", settings.ray_address, settings.namespace)
        ray.init(address=settings.ray_address, namespace=settings.namespace, log_to_driver=False)
        return True
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # every Ray listener on 127.0.0.1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    resources = {settings.resource: local_slots} if settings.resource else None
    log.info("starting a local Ray for deferred workers (namespace %s)", settings.namespace)
    ray.init(address="local", namespace=settings.namespace, include_dashboard=False, resources=resources,
             log_to_driver=False)
    return True


def actor_prefix(model: str) -> str:
    """Names of the registered deferred workers serving `model` start with this."""
    return f"deferred:{model}:"


def own_prefix(model: str) -> str:
    """Names of a decode worker's own deferred workers (never taken for registered ones)."""
    return f"own:{model}:"


def registered(settings: DeferredSettings, model: str) -> dict[str, ray.actor.ActorHandle]:
    """The live actors registered by name in the namespace for `model`, by name."""
    prefix = actor_prefix(model)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == settings.namespace and a["name"].startswith(prefix))
    found = {}
    for name in names:
        try:
            found[name] = ray.get_actor(name, namespace=settings.namespace)
        except ValueError:   # gone since it was listed
            continue
    return found


def actor_options(settings: DeferredSettings) -> dict:
    """What each deferred worker asks Ray for: the resource shape the autoscaler provides nodes for."""
    options = dict(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, namespace=settings.namespace)
    if settings.resource:
        options["resources"] = {settings.resource: 1}
    return options


def start_actor(settings: DeferredSettings, spec: ModelSpec, **options: Any) -> ray.actor.ActorHandle:
    """A new deferred worker (its checkpoint loads in the background; calls queue until it has)."""
    return _Remote.options(**actor_options(settings), **options).remote(spec, int(settings.resident_mib * MiB))
