"""What a step reads of its sessions beyond its plan: the scheduler's scratch rows and the update's view
of the sessions a plan names. Kept apart from engine/plan.py so that the plan, which the runner reads,
names no session object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..multimodal.turn_input import TurnInput
    from ..speculative.drafter import Drafter
    from .request import TurnRequest
    from .session_cache import SessionCache


@dataclass(eq=False)
class ScratchWork:
    """A scratch session (no turn, no recovery) and its rows: a deferred worker's residual, prefilled
    through the ordinary step from `cursor` on, or a session-free forward's rows; `error` is set when a
    step holding only them fails."""

    cache: SessionCache
    input: TurnInput
    cursor: int = 0
    error: Exception | None = None

    @property
    def pending(self) -> int:
        return len(self.input) - self.cursor


class StepSessions(Protocol):
    """What the update reads a plan's sessions through (the engine core implements it)."""

    drafter: Drafter | None       # told what each turn ran and kept (speculative decoding; None: off)

    def cache(self, session: str) -> SessionCache: ...

    def turn(self, session: str) -> TurnRequest | None: ...

    def scratch(self, session: str) -> ScratchWork | None:
        """A scratch session's rows and how far the step has prefilled them (None: not a scratch session)."""
        ...
