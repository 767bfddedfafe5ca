"""Typed errors of the engine. Services map each class to one gRPC status code."""

from __future__ import annotations


class RaincheckError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidInputError(RaincheckError, ValueError):
    """The caller's input is malformed (shapes, token/visual mismatch, bad sampling values)."""


class RequestTooLargeError(InvalidInputError):
    """The turn can never be served, whatever the load: its conversation plus its prompt plus
    `max_new_tokens` exceed the model's context length, or more slots than the session or the whole
    pool can hold. Waiting does not cure it (unlike `OutOfPagesError`)."""

    def __init__(self, message: str, limit: int, requested: int):
        self.limit = limit
        self.requested = requested
        super().__init__(message)


class UnsupportedModelError(RaincheckError):
    """The checkpoint's model_type (or a feature it needs) is not implemented."""


class CheckpointError(RaincheckError):
    """A checkpoint folder cannot be loaded: missing files, missing or unexpected tensors, bad shapes."""

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None):
        self.missing = sorted(missing or [])
        self.unexpected = sorted(unexpected or [])
        parts = [message]
        if self.missing:
            parts.append(f"missing tensors ({len(self.missing)}): {_preview(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected tensors ({len(self.unexpected)}): {_preview(self.unexpected)}")
        super().__init__("; ".join(parts))


class NoMtpHeadError(CheckpointError):
    """MTP speculative decoding was asked of a checkpoint that ships no multi-token-prediction head (no
    `mtp.*` tensors): a Qwen3-VL checkpoint, or a Qwen3.5 one exported without it."""


class OutOfPagesError(RaincheckError):
    """The KV page pool (or a session's page budget) cannot hold the request."""

    unit = "pages"

    def __init__(self, message: str, needed: int, available: int):
        self.what = message
        self.needed = needed
        self.available = available
        super().__init__(f"{message}: needs {needed} {self.unit}, {available} available")


class SessionPageBudgetError(OutOfPagesError):
    """The request needs more pages than its session's own page budget allows: freeing other sessions'
    pages would not help."""


class GDNSlotsExhaustedError(OutOfPagesError):
    """Every GDN state slot is taken (each open session of a GDN model holds one); `needed` and
    `available` count slots."""

    def __init__(self, message: str, needed: int, available: int):
        self.unit = "GDN state slot" + ("s" if needed != 1 else "")
        super().__init__(message, needed, available)


class SessionClosedError(RaincheckError):
    """The session was closed; its cache is gone."""


class SessionBusyError(RaincheckError):
    """A turn was started while the session's previous turn is still running."""


class SamplingError(RaincheckError):
    """No token can be drawn from a turn's logits (none is usable), or sampling failed; fails that turn
    only (it is undone), the others in its step go on."""


class GrammarError(InvalidInputError, SamplingError):
    """The turn's grammar (structured output) asks for what the model's vocabulary cannot write: found before
    the turn runs (refused, as any invalid input), or at a dead end while it answers (that turn fails, as a
    sampling failure does, and is undone). Either way the caller's request, not the server, is at fault, and
    the message says what cannot be written."""


class StepFailedError(RaincheckError):
    """The forward pass that ran this turn's rows failed (alone, so it was this turn's own); the turn is
    undone: the session's cache is as it was before the turn started."""


class RankFailedError(RaincheckError):
    """A collective of a tensor-parallel engine failed or timed out: another rank died or stopped
    answering. The engine cannot serve until its ranks are restarted."""


class TurnAbortedError(RaincheckError):
    """The turn was stopped and undone (`Session.abort`): nobody was left to read its answer."""


class RecoveryStateError(RaincheckError):
    """A hand-off verb does not fit the session's recovery: nothing to hand off, or a result for an
    earlier recovery (a stale result is never applied)."""


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … (+{len(names) - limit} more)" if len(names) > limit else "")
