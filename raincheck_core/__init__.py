"""Raincheck Serve's engine library: models, cache, deferred multimodal prefill. No gRPC, Ray or Redis."""

from .config import EngineConfig, ModelConfig
from .deferral.policy import DeferralConfig
from .engine import Engine, Session, TokenEvent, TurnEnd, TurnMetrics
from .errors import (
    CheckpointError,
    GrammarError,
    InvalidInputError,
    OutOfPagesError,
    RaincheckError,
    RequestTooLargeError,
    SamplingError,
    SessionBusyError,
    SessionClosedError,
    UnsupportedModelError,
)
from .inputs import Message, Prompt, RenderOptions, VisualInput
from .sampling_params import SamplingParams

__all__ = [
    "CheckpointError", "DeferralConfig", "Engine", "EngineConfig", "GrammarError", "InvalidInputError", "Message",
    "ModelConfig", "OutOfPagesError", "Prompt", "RaincheckError", "RenderOptions", "RequestTooLargeError",
    "SamplingError", "SamplingParams", "Session", "SessionBusyError",
    "SessionClosedError", "TokenEvent", "TurnEnd", "TurnMetrics", "UnsupportedModelError", "VisualInput",
]
