"""Errors the SDK raises: one class per gRPC status code the service uses, all `RaincheckError`s."""

from __future__ import annotations

import grpc


class RaincheckError(Exception):
    """A call failed; `code` is the gRPC status code name (e.g. "NOT_FOUND"), `message` the server's text."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class InvalidArgument(RaincheckError):
    """Malformed input: an empty message, an undecodable or oversized image, out-of-range settings."""


class NotFound(RaincheckError):
    """Unknown or closed session, or no worker serves the requested model."""


class PermissionDenied(RaincheckError):
    """The session belongs to another API key."""


class Unauthenticated(RaincheckError):
    """No API key, or an unknown one."""


class FailedPrecondition(RaincheckError):
    """The session's previous turn is still streaming (or the requested mode is not offered)."""


class ResourceExhausted(RaincheckError):
    """A key's quota, or the worker's KV pages or GDN state slots held by busy sessions: a later try can
    succeed (the message names what is missing)."""


class Unavailable(RaincheckError):
    """No healthy decode worker, or the server cannot be reached (`Client(wait_ready=...)` waits for a
    server that is starting)."""


class Cancelled(RaincheckError):
    """The call was cancelled."""


_BY_CODE: dict[str, type[RaincheckError]] = {
    "INVALID_ARGUMENT": InvalidArgument, "NOT_FOUND": NotFound, "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated, "FAILED_PRECONDITION": FailedPrecondition,
    "RESOURCE_EXHAUSTED": ResourceExhausted, "UNAVAILABLE": Unavailable, "CANCELLED": Cancelled,
}


def error_for(code: str, message: str) -> RaincheckError:
    return _BY_CODE.get(code, RaincheckError)(code, message)


def from_rpc_error(error: grpc.RpcError) -> RaincheckError:
    """The SDK error for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code = error.code()
    return error_for(code.name if code is not None else "UNKNOWN", error.details() or "")
