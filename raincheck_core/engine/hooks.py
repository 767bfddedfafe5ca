"""Instrumentation hooks of the engine core: who is told of a step's plan, of a step that ran, and of a
recovery that completed (benchmarks, tests, the services' metrics). Hooks observe; the core's state
changes only by its own verbs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import ANSWERING, Kind, StepPlan

if TYPE_CHECKING:
    from ..deferral.recovery import Recovery
    from ..ops.gdn_traffic import GDNTraffic
    from .session_cache import SessionCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """One step as the instrumentation hooks see it (`EngineCore.on_step`)."""

    decode_rows: int
    prefill_rows: int
    deferred_rows: int          # fused into decode steps (Kind.DEFERRED)
    recovery_rows: int          # post-answer chunks (Kind.RECOVERY)
    residual_rows: int          # scratch rows (a hand-off's prefill)
    handoff_rows: int           # deferred rows joined from a deferred worker's result (Kind.HANDOFF)
    tracked_rows: int           # decode rows that extend a GDN join's map
    sessions: int
    seconds: float              # the engine's clock, as the TPOT objective sees it
    failed: bool                # the forward raised (the step was re-run session by session, or failed a turn)
    gdn_traffic: GDNTraffic | None = None   # bytes of GDN state moved and required (ops/gdn_traffic.py)
    draft_rows: int = 0         # draft tokens verified (Kind.VERIFY rows after each turn's first)

    @classmethod
    def of(cls, plan: StepPlan, seconds: float, failed: bool, gdn_traffic: GDNTraffic | None = None) -> StepStats:
        rows = dict.fromkeys(Kind, 0)
        answers = tracked = drafts = 0
        for s in plan.segments:     # one pass: a decode step's segments are its sessions, 64 or more
            rows[s.kind] += s.rows
            answers += s.kind in ANSWERING      # a verify segment's first row is its turn's decode row
            tracked += s.tracked
            drafts += len(s.drafts)
        return cls(answers, rows[Kind.PREFILL], rows[Kind.DEFERRED], rows[Kind.RECOVERY], rows[Kind.RESIDUAL],
                   rows[Kind.HANDOFF], tracked, len(plan.sessions()), seconds, failed, gdn_traffic, drafts)


class Hooks:
    """The registered hooks, by event; each `on_*` returns the hook's remover."""

    def __init__(self) -> None:
        self.plan: list[Callable[[StepPlan], None]] = []
        self.read: list[Callable[[StepPlan], None]] = []
        self.step: list[Callable[[StepStats], None]] = []
        self.recovery: list[Callable[[SessionCache, Recovery], None]] = []

    def on_plan(self, hook: Callable[[StepPlan], None]) -> Callable[[], None]:
        """`hook(plan)` before each forward of a step (each pass, each solo re-run); one that raises fails
        that forward as the model would (fault injection in tests)."""
        return _added(self.plan, hook)

    def on_read(self, hook: Callable[[StepPlan], None]) -> Callable[[], None]:
        """`hook(plan)` where each pass's update first reads a value its forward computed (its logits): what
        the update did before needs none, so on a device it runs while the forward computes, and the host
        waits for the forward here."""
        return _added(self.read, hook)

    def reading(self, plan: StepPlan) -> Callable[[], None] | None:
        """What the update calls before it first reads `plan`'s forward's values (None: no read hook)."""
        if not self.read:
            return None
        hooks = list(self.read)

        def read() -> None:
            for hook in hooks:
                try:
                    hook(plan)
                except Exception:   # the update is half applied here: an observer's failure must not stop it
                    log.exception("a read hook failed")
        return read

    def on_step(self, hook: Callable[[StepStats], None]) -> Callable[[], None]:
        """`hook(stats)` after each step, with its rows by kind and its time on the engine's clock."""
        return _added(self.step, hook)

    def on_recovery_done(self, hook: Callable[[SessionCache, Recovery], None]) -> Callable[[], None]:
        """`hook(cache, recovery)` when a recovery is complete, before its prefix state is released."""
        return _added(self.recovery, hook)


def _added(hooks: list, hook: Callable) -> Callable[[], None]:
    hooks.append(hook)
    return lambda: hooks.remove(hook)
