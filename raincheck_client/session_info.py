"""A session's settings and live status, as the frontend reports them."""

from __future__ import annotations

from dataclasses import dataclass

from ._gen import chat_pb2

RECOVERY_MODES = {"colocated": chat_pb2.RECOVERY_MODE_COLOCATED,
                  "disaggregated": chat_pb2.RECOVERY_MODE_DISAGGREGATED}


def mode_name(mode: int) -> str:
    return chat_pb2.RecoveryMode.Name(mode).removeprefix("RECOVERY_MODE_").lower()


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    model: str
    policy: str
    selector: str
    retention: float | None
    chunk_size: int | None
    guard: int | None
    tpot_slo: float | None            # None: no objective (fixed chunks)
    barrier_timeout_s: float | None   # None: a turn waits for the previous turn's deferred rows
    deterministic: bool               # same answer for the same request (docs/services.md)
    recovery_mode: str                # colocated | disaggregated
    status: str                       # idle | streaming | recovering | detached
    turns: int
    pending_deferred_tokens: int
    cached_tokens: int
    worker_id: str

    @classmethod
    def from_proto(cls, info: chat_pb2.SessionInfo) -> SessionInfo:
        d = info.deferral
        return cls(
            info.session_id, info.model, d.policy, d.selector,
            d.retention if d.HasField("retention") else None,
            d.chunk_size if d.HasField("chunk_size") else None,
            d.guard if d.HasField("guard") else None,
            d.tpot_slo or None,
            d.barrier_timeout_s if d.HasField("barrier_timeout_s") and d.barrier_timeout_s >= 0 else None,
            d.deterministic,
            mode_name(info.recovery_mode),
            chat_pb2.SessionStatus.Name(info.status).removeprefix("SESSION_STATUS_").lower(),
            info.turns, info.pending_deferred_tokens, info.cached_tokens, info.worker_id,
        )


@dataclass(frozen=True)
class ModelInfo:
    name: str
    workers: int
    recovery_modes: list[str]

    @classmethod
    def from_proto(cls, info: chat_pb2.ModelInfo) -> ModelInfo:
        return cls(info.name, info.workers, [mode_name(m) for m in info.recovery_modes])
