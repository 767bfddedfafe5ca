"""Waiting for a server that is starting, shared by the sync and asyncio clients.

A server that has just been started is first unreachable (its port is not open yet), then reachable but
not ready (its worker is loading the model and warming up: the frontend answers `UNAVAILABLE: no healthy
decode worker is registered`), then ready. Two tools, both bounded in time:
- `wait_ready(timeout_s)`: polls the server's standard gRPC health (`grpc.health.v1.Health/Check`, service
  "", the call carrying `wait_for_ready`) until it says SERVING; `Unavailable` naming the last reason when
  it has not after `timeout_s`. `Client(..., wait_ready=...)` does it before the constructor returns.
- Calls that a server refuses before accepting anything (opening a session, a session's status, the
  models) carry `wait_for_ready` (a connection not up yet is waited for, not failed) and are retried, with
  backoff, while they fail with UNAVAILABLE, within the call's deadline (`timeout_s`); `retry=False`
  turns this off. A turn (`send`) is never retried: its stream may have begun.

The health messages are written by hand (a request for service "" is empty; the reply's field 1 is the
status, SERVING = 1), so the SDK still needs only grpcio and protobuf.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc

from .errors import Unavailable, from_rpc_error

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = 1
DEFAULT_READY_S = 60.0          # `wait_ready=True`
CHECK_S = 1.0                   # one health check's deadline (the progress callback is told at least this often)
# reconnect at least every second while the server is down (gRPC's default backoff grows to 2 minutes)
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
Progress = Callable[[str, float], None]     # (why it is not ready yet, seconds waited so far)


def identity(data: bytes) -> bytes:
    return data


def health_status(reply: bytes) -> int:
    """The `status` of a serialized HealthCheckResponse (field 1, a varint; absent: UNKNOWN, 0)."""
    if len(reply) < 2 or reply[0] != 0x08:
        return 0
    status, shift = 0, 0
    for byte in reply[1:]:
        status |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return status


def backoff() -> Iterator[float]:
    """Pauses between tries: 50 ms, doubling, at most 1 s."""
    delay = 0.05
    while True:
        yield delay
        delay = min(delay * 2, 1.0)


class ReadyWait:
    """One wait for readiness (`wait_ready`): each health check's deadline, and what its outcome means. The
    sync and asyncio clients make the checks and the pauses."""

    def __init__(self, address: str, timeout_s: float, progress: Progress | None):
        self.address = address
        self.timeout_s = timeout_s
        self.progress = progress
        self.start = time.monotonic()
        self._pauses = backoff()
        self._answered: str | None = None       # the reason the last answer gave, once the server has answered

    def check_timeout(self) -> float:
        return max(min(self.timeout_s - (time.monotonic() - self.start), CHECK_S), 0.001)

    def after(self, reply: bytes | None, error: grpc.RpcError | None) -> float | None:
        """None once ready (SERVING, or a server without health); else the pause before the next check.
        Unavailable, saying why, once the time is up."""
        if error is not None:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:      # no health service: nothing to wait for
                return None
            # a check that ran out of time after the server had answered (a loaded host, or the last check's
            # short deadline) says nothing new: the server's own last answer is still the reason
            timed_out = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            why = self._answered if timed_out and self._answered else "not reachable yet"
        elif health_status(reply or b"") == SERVING:
            return None
        else:
            why = self._answered = "loading its model"
        waited = time.monotonic() - self.start
        if waited >= self.timeout_s:
            raise Unavailable("UNAVAILABLE", f"the server at {self.address} is not ready after {waited:.0f} s ({why})")
        if self.progress is not None:
            self.progress(why, waited)
        return min(next(self._pauses), self.timeout_s - waited)


class CallTries:
    """One unary call's tries: with `retry`, each carries wait_for_ready, and UNAVAILABLE is tried again
    after a pause while the call's deadline (`timeout_s` from the first try) allows."""

    def __init__(self, address: str, timeout_s: float | None, retry: bool):
        self.address = address
        self.timeout_s = timeout_s
        self.wait_for_ready = retry or None
        self.retry = retry
        self.start = time.monotonic()
        self._pauses = backoff()

    def timeout(self) -> float | None:
        return None if self.timeout_s is None else max(self.timeout_s - (time.monotonic() - self.start), 0.001)

    def ask_reachable(self, error: grpc.RpcError) -> bool:
        """Whether `after` needs to know if the server answers at all: a try that waited for a connection
        until its deadline."""
        return self.retry and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def after(self, error: grpc.RpcError, reachable: bool) -> float:
        """The pause before the next try; raises the SDK's error when there is none."""
        waited = time.monotonic() - self.start
        if self.ask_reachable(error) and not reachable:
            # the deadline went by waiting for a connection: the server was never reached
            raise Unavailable("UNAVAILABLE", f"the server at {self.address} could not be reached in {waited:.1f} s")
        pause = next(self._pauses)
        if self.retry and error.code() == grpc.StatusCode.UNAVAILABLE and \
                (self.timeout_s is None or waited + pause < self.timeout_s):
            return pause
        raise from_rpc_error(error) from None
