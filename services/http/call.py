"""The context the frontend's ChatService sees when the HTTP layer calls it in-process.

The HTTP frontend runs every request through the same `ChatServicer` as gRPC clients, so auth, checks,
routing, rebuilds, turn logs and metrics are the frontend's own. The servicer reads the caller's
metadata, registers callbacks for the end of the call (they cancel the worker's stream), and ends
failed calls with `abort`; this class provides those for one HTTP request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import grpc

from ..common.grpc_util import ServiceError

if TYPE_CHECKING:
    from starlette.requests import Request

log = logging.getLogger(__name__)


class HttpCall:
    def __init__(self, authorization: str | None):
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self._lock = threading.Lock()

    @classmethod
    def of(cls, request: Request) -> HttpCall:
        """The call for one HTTP request: its `authorization` header is the caller's metadata."""
        return cls(request.headers.get("authorization"))

    # -- the part of grpc.ServicerContext the servicer uses --------------------------------------------
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
            return self._active

    def is_active(self) -> bool:
        return self._active

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise ServiceError(code, details)

    def peer(self) -> str:
        return "http"

    def time_remaining(self) -> float | None:
        return None

    # -- ours -----------------------------------------------------------------------------------------
    def end(self) -> None:
        """The HTTP request is over (answered, failed, or the client left): run the end-of-call callbacks."""
        with self._lock:
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("end-of-call callback failed")
