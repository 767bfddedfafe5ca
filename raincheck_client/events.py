"""What a turn streams, as plain dataclasses: `Token`s, `RecoveryProgress`, one `Metrics` and one `Final`
(per answer, with `Sampling(n=...)`)."""

from __future__ import annotations

from dataclasses import dataclass

from ._gen import chat_pb2
from .errors import error_for


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str            # the new text this token completes (may be empty)
    index: int           # position among the turn's generated tokens
    logprob: float | None = None      # with Sampling(logprobs=True)
    top_logprobs: tuple[tuple[int, str, float], ...] = ()   # (token id, token, logprob), most likely first
    choice: int = 0                   # which answer (Sampling(n=...))


@dataclass(frozen=True)
class Metrics:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    queue_s: float
    deferred_tokens: int              # visual tokens of this turn deferred
    deferred_pending: int             # of those, not yet prefilled when the answer ended
    tpot_restoring_s: float | None
    barrier_wait_s: float             # waited for the previous turn's recovery
    previous_recovery_s: float | None
    previous_pending: int = 0         # earlier turns' deferred tokens pending when this turn started
    choice: int = 0                   # which answer; answer 0's metrics and final come last
    cached_prompt_tokens: int = 0     # of prompt_tokens, served from the worker's prefix cache
    drafts_proposed: int = 0          # speculative decoding: draft tokens the worker verified
    drafts_accepted: int = 0          # … and of them, accepted


@dataclass(frozen=True)
class RecoveryProgress:
    pending_tokens: int               # deferred tokens of the turn not yet prefilled
    complete: bool
    elapsed_s: float                  # since the answer ended (0 while it streams)


@dataclass(frozen=True)
class Final:
    turn_id: str
    finish_reason: str                # stop | length | cancelled
    token_ids: list[int]
    text: str
    choice: int = 0                   # which answer; answer 0's (the one the session continues) comes last


Event = Token | Metrics | RecoveryProgress | Final


def _optional(msg, name: str) -> float | None:
    return getattr(msg, name) if msg.HasField(name) else None


def from_proto(event: chat_pb2.ChatEvent) -> Event:
    """The event, or raises the matching `RaincheckError` for an error event."""
    kind = event.WhichOneof("event")
    if kind == "token":
        t = event.token
        return Token(t.token_id, t.text, t.index, _optional(t, "logprob"),
                     tuple((a.token_id, a.token, a.logprob) for a in t.top_logprobs), t.choice)
    if kind == "recovery":
        r = event.recovery
        return RecoveryProgress(r.pending_tokens, r.complete, r.elapsed_s)
    if kind == "metrics":
        m = event.metrics
        return Metrics(m.prompt_tokens, m.generated_tokens, m.ttft_s, m.tpot_s, m.e2e_s, m.queue_s,
                       m.deferred_tokens, m.deferred_pending, _optional(m, "tpot_restoring_s"),
                       m.barrier_wait_s, _optional(m, "previous_recovery_s"), m.previous_pending, m.choice,
                       m.cached_prompt_tokens, m.drafts_proposed, m.drafts_accepted)
    if kind == "final":
        f = event.final
        return Final(event.turn_id, f.finish_reason, list(f.token_ids), f.text, f.choice)
    if kind == "error":
        raise error_for(event.error.code, event.error.message)
    raise ValueError(f"unknown chat event {kind!r}")
