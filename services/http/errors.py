"""Errors as OpenAI-shaped bodies (`{"error": {"message", "type", "param", "code"}}`) with the HTTP status
that matches the frontend's gRPC status. Every error has a `code` (a client can branch on it without reading
the message): the frontend's status name for what came from it, else one by what went wrong
(`unsupported_parameter`, `unknown_parameter`, `invalid_value`, ...), else one by the HTTP status."""

from __future__ import annotations

import grpc

from ..common.grpc_util import ServiceError

# gRPC status -> (HTTP status, OpenAI error type)
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "api_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
RETRY_AFTER_S = 1
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
# the code of an error that names none, by HTTP status
_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
          405: "method_not_allowed", 409: "conflict", 413: "request_too_large", 415: "unsupported_media_type",
          422: "invalid_request", 429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable",
          504: "timeout"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, type: str | None = None, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.code = code or _CODES.get(status, "invalid_request" if status < 500 else "server_error")
        self.param = param

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str = "invalid_value") -> HttpError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unsupported(cls, message: str, param: str) -> HttpError:
        """400 for a field this server does not honour (set to a value that asks for something)."""
        return cls(400, message, param=param, code="unsupported_parameter")

    @classmethod
    def from_service(cls, error: ServiceError) -> HttpError:
        status, kind = _FROM_GRPC.get(error.code, (500, "server_error"))
        code = "invalid_api_key" if error.code == grpc.StatusCode.UNAUTHENTICATED else error.code.name.lower()
        return cls(status, error.message, type=kind, code=code)

    @property
    def headers(self) -> dict[str, str] | None:
        """Retry-After where a retry can succeed: 429 (what is missing is held by others for now) and 503 (no
        worker yet, or one draining)."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
