"""The recovery modes, by the names settings, store records and worker registrations use
(`settings.RecoveryMode`) and as the wire's `RecoveryMode` enum."""

from __future__ import annotations

import typing

from raincheck_client._gen import chat_pb2

from .settings import RecoveryMode

MODES: dict[str, int] = {name: chat_pb2.RecoveryMode.Value(f"RECOVERY_MODE_{name.upper()}")
                         for name in typing.get_args(RecoveryMode)}
MODE_NAMES: dict[int, str] = {v: k for k, v in MODES.items()}
