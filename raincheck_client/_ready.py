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

from collections.abc import Callable, Iterator

import grpc

from .errors import Unavailable

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


def not_ready(address: str, waited_s: float, why: str) -> Unavailable:
    return Unavailable("UNAVAILABLE", f"the server at {address} is not ready after {waited_s:.0f} s ({why})")


def unreachable(address: str, waited_s: float) -> Unavailable:
    """A call that waited for a connection until its deadline: the server was never reached."""
    return Unavailable("UNAVAILABLE", f"the server at {address} could not be reached in {waited_s:.1f} s")


def retryable(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.UNAVAILABLE


def timed_out(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
