"""gRPC plumbing shared by the servers: thread-pool servers with health + reflection, status helpers."""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .metrics import REQUESTS

if TYPE_CHECKING:
    from google.protobuf.message import Message

log = logging.getLogger(__name__)
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}
ECHO_CHARS = 64          # of a caller's value quoted in an error message
MESSAGE_CHARS = 2048     # of any error message (a status message travels in gRPC metadata, which is bounded)


def shown(value: str, limit: int = ECHO_CHARS) -> str:
    """A caller's value as an error message quotes it: cut to `limit` characters, saying how long it was."""
    return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} characters)"


class ServiceError(Exception):
    """Ends an RPC with `code` and a message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")

    @classmethod
    def invalid(cls, message: str) -> ServiceError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def not_found(cls, message: str) -> ServiceError:
        return cls(grpc.StatusCode.NOT_FOUND, message)

    @classmethod
    def failed_precondition(cls, message: str) -> ServiceError:
        return cls(grpc.StatusCode.FAILED_PRECONDITION, message)

    @classmethod
    def unavailable(cls, message: str) -> ServiceError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)


Translate = Callable[[BaseException], "ServiceError | None"]


def rpc(service: str, translate: Translate) -> Callable:
    """Decorates a servicer method: errors (ServiceError, or what `translate` maps to one) end the RPC
    with their status code; anything else is logged and ends it with INTERNAL. Counts RPCs by code.
    A streaming method returns its iterator after doing its checks, so those errors end it before any
    message; failures inside the stream are the iterator's to report."""

    def decorate(method: Callable) -> Callable:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self, request: Message, context: grpc.ServicerContext) -> Message | Iterator[Message]:
            try:
                reply = method(self, request, context)
            except Exception as e:
                error = e if isinstance(e, ServiceError) else translate(e)
                if error is None:
                    log.exception("%s.%s failed", service, name)
                    error = ServiceError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
                REQUESTS.labels(service, name, error.code.name).inc()
                context.abort(error.code, shown(error.message, MESSAGE_CHARS))
            REQUESTS.labels(service, name, "OK").inc()
            return reply

        return wrapper

    return decorate


def make_server(max_workers: int, max_message_bytes: int) -> grpc.Server:
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)


class ReadinessHealth(health.HealthServicer):
    """`grpc.health.v1.Health` whose overall status ("" and the server's own services) is readiness: it
    starts NOT_SERVING and follows `set_ready`; a `refresh` hook, when given, runs before each Check so
    a probe never reads a stale answer (Watch streams get what `set_ready` last set)."""

    def __init__(self, service_names: list[str], refresh: Callable[[], None] | None = None):
        super().__init__()
        self.names = ["", *service_names]
        self.refresh = refresh
        self.ready: bool | None = None
        self.set_ready(False)

    def set_ready(self, ready: bool) -> None:
        if ready == self.ready:     # a Watch stream hears of changes only
            return
        self.ready = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            self.set(name, status)

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
              ) -> health_pb2.HealthCheckResponse:
        if self.refresh is not None:
            self.refresh()
        return super().Check(request, context)


def add_health_and_reflection(server: grpc.Server, service_names: list[str],
                              refresh: Callable[[], None] | None = None) -> ReadinessHealth:
    """Standard `grpc.health.v1.Health` (NOT_SERVING until the owner calls `set_ready(True)`) and server
    reflection."""
    servicer = ReadinessHealth(service_names, refresh)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (0: any free port); returns the bound port."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot listen on {address}")
    return bound


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel(address: str, max_message_bytes: int) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    return grpc.insecure_channel(address, options)
