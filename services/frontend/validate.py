"""Checks on a user message before it goes to a worker, cheapest first (the worker checks what needs the
model): counts and sizes, then text length, then each image's header (its pixel count, read without
decoding). Sampling values are the engine's to judge (`SamplingParams`); its InvalidInputError comes back
from the worker as INVALID_ARGUMENT before anything runs."""

from __future__ import annotations

import io

from PIL import Image

from raincheck_client._gen import chat_pb2

from ..common.grpc_util import ServiceError
from ..common.settings import FrontendSettings


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MiB"


def image_size_problem(name: str, data: bytes, limit: int, *, in_mib: bool = True) -> str | None:
    """Why an encoded image is refused before anything reads it (empty, or over `limit` bytes), naming it
    `name`; None when it is not. The HTTP API, which checks each image as it loads it, gives the sizes in
    bytes (`in_mib` False), the gRPC frontend in MiB."""
    if not data:
        return f"{name} is empty"
    if len(data) > limit:
        size, most = (_mib(len(data)), _mib(limit)) if in_mib else (f"{len(data)} bytes", str(limit))
        return f"{name} is {size}; the limit is {most}"
    return None


def check_message(m: chat_pb2.UserMessage, limits: FrontendSettings) -> None:
    """INVALID_ARGUMENT for an empty message, text too long, or images/frames empty, too many, too large
    (bytes, or pixels as their headers say), or not an image at all."""
    if not m.text.strip() and not m.images and not m.videos:
        raise ServiceError.invalid("empty message: send text, images or videos")
    if len(m.text) > limits.max_text_chars:
        raise ServiceError.invalid(f"the text has {len(m.text)} characters; the limit is {limits.max_text_chars}")
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
        if problem := image_size_problem(name, data, limits.max_image_bytes):
            raise ServiceError.invalid(problem)
    total = 0
    for name, data in items:
        width, height = _size(name, data)
        if width * height > limits.max_image_pixels:
            raise ServiceError.invalid(f"{name} is {width}x{height} pixels; the limit is "
                                       f"{limits.max_image_pixels} pixels")
        total += width * height
    if total > limits.max_message_pixels:
        raise ServiceError.invalid(f"the message's images and frames have {total} pixels in all; the limit is "
                                   f"{limits.max_message_pixels}")


def _size(name: str, data: bytes) -> tuple[int, int]:
    """(width, height) from the image's header; Pillow's open() reads nothing more."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ServiceError.invalid(f"{name} ({len(data)} bytes) could not be decoded as an image "
                                   "(its header names no image format Pillow reads)") from e
