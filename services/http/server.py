"""The HTTP frontend as a server: uvicorn on its own thread, in front of the frontend's ChatService.

`HttpServer(settings, frontend, store)` serves the same workers and store as the gRPC frontend: next to
one in the same process (`raincheck serve --http-port`, passing that frontend's router), or alone
(`raincheck http`). Keys, limits and TLS come from the frontend's settings.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from ..common.settings import FrontendSettings
from ..common.store import Store
from ..frontend.auth import check_auth_settings
from ..frontend.router import Router
from ..frontend.servicer import ChatServicer
from .app import build_app
from .index import make_index
from .session_matching import ChatBackend
from .settings import HttpSettings

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class HttpServer:
    def __init__(self, settings: HttpSettings, frontend: FrontendSettings, store: Store, router: Router | None = None):
        if settings.port is None:
            raise ValueError("the HTTP frontend needs a port")
        check_auth_settings(frontend, settings.host, "HTTP")     # the gRPC frontend's rule, for this address
        self.settings = settings
        self._own_router = router is None
        self.router = router or Router(store, frontend.max_message_bytes)
        backend = ChatBackend(ChatServicer(frontend, store, self.router), store, make_index(store))
        self.app = build_app(backend, settings, frontend.max_image_bytes, frontend.max_message_bytes)
        self.tls = bool(frontend.tls_cert)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=frontend.drain_s, ssl_certfile=frontend.tls_cert,
                                ssl_keyfile=frontend.tls_key)
        self._server = uvicorn.Server(config)
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((settings.host, settings.port))
        self.port = self._socket.getsockname()[1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        self.url = f"{'https' if self.tls else 'http'}://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="raincheck-http", daemon=True)

    def start(self) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP frontend did not start on {self.url}")
            time.sleep(0.01)
        log.info("HTTP frontend (OpenAI /v1, SGLang /generate) at %s", self.url, extra={"service": "http"})
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking requests; running answers get `grace_s` to finish (uvicorn's graceful shutdown)."""
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.5)   # 0 would report a timeout at once
        self._server.should_exit = True
        self._thread.join(timeout=grace_s + 5)
        self._socket.close()
        if self._own_router:
            self.router.close()
