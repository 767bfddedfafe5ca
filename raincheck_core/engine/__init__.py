"""Engine, sessions and the step loop (one step, whole: engine/step.py)."""

from .engine import Engine
from .events import TokenEvent, TurnEnd, TurnEvent, TurnMetrics
from .request import answer_tail
from .session import Session, SessionStatus, TurnStream

__all__ = ["Engine", "Session", "SessionStatus", "TokenEvent", "TurnEnd", "TurnEvent", "TurnMetrics", "TurnStream",
           "answer_tail"]
