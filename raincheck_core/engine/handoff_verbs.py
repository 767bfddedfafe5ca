"""The hand-off verbs the Engine facade offers a deferred worker's caller (docs/mechanism.md §8): each runs
under the engine lock and, on ranks the engine started, is sent to the worker ranks first
(engine/mirror.py), a payload or result split into each rank's part or merged on rank 0
(parallel/handoff_parts.py). What a verb does to a session's cache and the pools is engine/residual.py's.
Kept apart from the facade, which delegates to it, so that the rank plumbing of hand-offs reads in one
place."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..config import ModelConfig
from ..deferral.handoff import Joined, ResidualPayload, ResidualResult
from ..parallel.handoff_parts import merge_payloads, merge_results, payload_part, result_part, to_cpu
from . import residual
from .core import EngineCore
from .engine_lock import EngineLock
from .session import Session
from .stepper import Stepper

T = TypeVar("T", ResidualPayload, ResidualResult)


class HandOffVerbs:
    """`Engine.hold_residual`, `export_residual`, `prefill_residual`, `apply_residual` and `take_back`
    (their contracts are the facade's docstrings). `replicated`: the engine is rank 0 or a replica of ranks
    an engine started, so its hand-offs carry whole heads."""

    def __init__(self, core: EngineCore, stepper: Stepper, lock: EngineLock):
        self.core = core
        self.stepper = stepper
        self.lock = lock

    def hold(self, session: Session, fuse: bool) -> int | None:
        """Reserve the session's current recovery for a deferred worker; its ticket, or None."""
        with self.lock, self.core.replicate("hold_residual", session.id, fuse):
            rec = session.cache.recovery
            if rec is None or rec.done:
                return None
            rec.hold(fuse)
            return rec.turn

    def export(self, session: Session, ticket: int, have: torch.Tensor | None, replicated: bool) -> ResidualPayload:
        """What the held recovery's remaining rows may see, and the rows (engine/residual.py `export`)."""
        with self.lock, self.core.replicate("export_residual", session.id, ticket, have):
            return self.whole(residual.export(self.core, session.cache, ticket, have), merge_payloads, replicated)

    def prefill(self, payload: ResidualPayload, replicated: bool) -> ResidualResult:
        """Deferred-worker side: the payload's rows prefilled on top of its context (engine/residual.py)."""
        with self.lock, self.core.replicate("prefill_residual", payload):
            if replicated:
                payload = payload_part(payload, self.core.model_config, self.core.model.tp.shard)
            return self.whole(residual.prefill(self.stepper, payload), merge_results, replicated)

    def apply(self, session: Session, ticket: int, result: ResidualResult, replicated: bool) -> Joined | None:
        """Join a deferred worker's result (engine/residual.py `apply`); None: not yet."""
        with self.lock, self.core.replicate("apply_residual", session.id, ticket, result):
            if replicated:
                result = result_part(result, self.core.model_config, self.core.model.tp.shard)
            return residual.apply(self.stepper, session.cache, ticket, result)

    def take_back(self, session: Session, ticket: int) -> bool:
        """The held recovery goes back to local recovery; False when it is no longer held."""
        with self.lock, self.core.replicate("take_back", session.id, ticket):
            rec = session.cache.recovery
            if rec is None or rec.turn != ticket or not rec.held:
                return False
            rec.take_back()
            self.stepper.wake()
            return True

    def whole(self, part: T, merge: Callable[[list[T], ModelConfig], T], replicated: bool) -> T:
        """A hand-off's payload or result as this engine ships it: its own, or on ranks an engine started,
        every rank's part merged on rank 0 (whole heads, for a receiver of any tensor_parallel_size;
        parallel/handoff_parts.py). A replica gets None back (nobody reads it)."""
        if not replicated:
            return part
        parts = self.core.model.tp.gather_object(to_cpu(part))
        return None if parts is None else merge(parts, self.core.model_config)
