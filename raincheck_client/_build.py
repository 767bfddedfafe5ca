"""Building the service's request messages from plain Python values."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from ._gen import chat_pb2
from .sampling import Sampling
from .session_info import RECOVERY_MODES

ImageSource = bytes | bytearray | str | os.PathLike
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def credentials(tls: bool | bytes | None) -> grpc.ChannelCredentials | None:
    """None/False: plaintext; True: TLS with the system's roots; bytes: TLS with these PEM roots."""
    if not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=None if tls is True else tls)


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _image_bytes(source: ImageSource) -> bytes:
    """Encoded image bytes, as given or read from a file path."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    return Path(source).read_bytes()


def deferral(policy: str | None = None, selector: str | None = None, retention: float | None = None,
             chunk_size: int | None = None, guard: int | None = None,
             tpot_slo: float | None = None, barrier_timeout_s: float | None = None,
             deterministic: bool | None = None) -> chat_pb2.DeferralSettings:
    return chat_pb2.DeferralSettings(policy=policy or "", selector=selector or "", retention=retention,
                                     chunk_size=chunk_size, guard=guard, tpot_slo=tpot_slo,
                                     barrier_timeout_s=barrier_timeout_s, deterministic=deterministic)


def create_session(model: str, recovery: str | None, **policy: Any) -> chat_pb2.CreateSessionRequest:
    """`recovery` None: the server's default mode."""
    if recovery is not None and recovery not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {sorted(RECOVERY_MODES)}, got {recovery!r}")
    mode = chat_pb2.RECOVERY_MODE_UNSPECIFIED if recovery is None else RECOVERY_MODES[recovery]
    return chat_pb2.CreateSessionRequest(model=model, deferral=deferral(**policy), recovery_mode=mode)


def chat(session_id: str, text: str, images: Sequence[ImageSource], videos: Sequence[Sequence[ImageSource]],
         *, follow_recovery: bool, policy: dict | None, options: Sampling | None = None,
         **sampling: Any) -> chat_pb2.ChatRequest:
    """`sampling`: temperature, top_p, top_k, seed, max_new_tokens (None = server default), ignore_eos;
    `options`: OpenAI's other sampling fields."""
    message = chat_pb2.UserMessage(
        text=text, images=[_image_bytes(i) for i in images],
        videos=[chat_pb2.Video(frames=[_image_bytes(f) for f in frames]) for frames in videos],
    )
    options = (options or Sampling()).apply(chat_pb2.SamplingOptions(**sampling))
    return chat_pb2.ChatRequest(
        session_id=session_id, message=message, sampling=options,
        deferral=deferral(**policy) if policy else None, follow_recovery=follow_recovery,
    )
