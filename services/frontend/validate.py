"""Checks on a user message before it goes to a worker (the worker checks what needs the model)."""

from __future__ import annotations

from raincheck_client._gen import chat_pb2

from ..common.grpc_util import ServiceError
from ..common.settings import FrontendSettings


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MiB"


def check_message(m: chat_pb2.UserMessage, limits: FrontendSettings) -> None:
    """INVALID_ARGUMENT for an empty message, or images/frames empty, too many or too large."""
    if not m.text.strip() and not m.images and not m.videos:
        raise ServiceError.invalid("empty message: send text, images or videos")
    if len(m.images) > limits.max_images:
        raise ServiceError.invalid(f"{len(m.images)} images in one message; the limit is {limits.max_images}")
    frames = sum(len(v.frames) for v in m.videos)
    if frames > limits.max_video_frames:
        raise ServiceError.invalid(f"{frames} video frames in one message; the limit is {limits.max_video_frames}")
    items = [(f"image {i}", data) for i, data in enumerate(m.images)]
    for v, video in enumerate(m.videos):
        if not video.frames:
            raise ServiceError.invalid(f"video {v} has no frames")
        items += [(f"video {v} frame {f}", data) for f, data in enumerate(video.frames)]
    for name, data in items:
        if not data:
            raise ServiceError.invalid(f"{name} is empty")
        if len(data) > limits.max_image_bytes:
            raise ServiceError.invalid(f"{name} is {_mib(len(data))}; the limit is {_mib(limits.max_image_bytes)}")
