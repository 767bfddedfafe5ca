"""Multimodal input: 3-D positions, the vision tower, and chat templating (Message -> Prompt)."""

from __future__ import annotations

from .chat import ChatFormatter
from .positions import PromptLayout, VisualSpan, compute_positions
from .vision import VideoSettings, VisionEncoder, load_image

__all__ = [
    "ChatFormatter",
    "PromptLayout",
    "VideoSettings",
    "VisionEncoder",
    "VisualSpan",
    "compute_positions",
    "load_image",
]
