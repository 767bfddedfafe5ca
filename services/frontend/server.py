"""A frontend process: the ChatService gRPC server (health, reflection, optional TLS)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from raincheck_client._gen import chat_pb2, chat_pb2_grpc

from ..common.grpc_util import add_health_and_reflection, bind, make_server
from ..common.settings import FrontendSettings
from ..common.store import Store
from .auth import check_auth_settings
from .readiness import Readiness
from .router import Router
from .servicer import ChatServicer

log = logging.getLogger(__name__)
SERVICE_NAME = chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name


def _credentials(settings: FrontendSettings) -> grpc.ServerCredentials | None:
    if not settings.tls_cert and not settings.tls_key:
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise SystemExit("TLS needs both --tls-cert and --tls-key")
    pair = (Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair])


class FrontendServer:
    def __init__(self, settings: FrontendSettings, store: Store):
        check_auth_settings(settings)
        self.settings = settings
        self.router = Router(store, settings.max_message_bytes)
        self.server = make_server(settings.threads, settings.max_message_bytes)
        chat_pb2_grpc.add_ChatServiceServicer_to_server(ChatServicer(settings, store, self.router), self.server)
        self.readiness = Readiness(store)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME], self.readiness.refresh)
        self.port = bind(self.server, settings.host, settings.port, _credentials(settings))
        self.address = f"{settings.host}:{self.port}"

    def start(self) -> FrontendServer:
        self.readiness.start(self.health)
        self.server.start()
        log.info("frontend serving %s at %s (auth %s)", SERVICE_NAME, self.address,
                 "on" if self.settings.api_keys else "OFF", extra={"service": "frontend"})
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.readiness.stop()
        self.server.stop(grace_s).wait()
        self.router.close()
