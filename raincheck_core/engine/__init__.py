"""Engine, sessions and the step loop."""

from .engine import Engine
from .events import TokenEvent, TurnEnd, TurnEvent, TurnMetrics
from .session import Session, TurnStream

__all__ = ["Engine", "Session", "TokenEvent", "TurnEnd", "TurnEvent", "TurnMetrics", "TurnStream"]
