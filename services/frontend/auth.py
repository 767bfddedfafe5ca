"""API keys: a caller presents `authorization: Bearer <key>`; a session belongs to the key that made it.

Keys are never stored: records hold a key id (a prefix of the key's sha256)."""

from __future__ import annotations

import hashlib
import logging

import grpc

from ..common.grpc_util import ServiceError
from ..common.settings import FrontendSettings, no_auth_refusal

log = logging.getLogger(__name__)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Auth:
    def __init__(self, keys: tuple[str, ...]):
        self._ids = {hashlib.sha256(k.encode()).digest(): key_id(k) for k in keys}

    def identify(self, context: grpc.ServicerContext) -> str:
        """The caller's key id ("" when auth is off); UNAUTHENTICATED without a valid key."""
        if not self._ids:
            return ""
        header = dict(context.invocation_metadata()).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing API key: send the metadata 'authorization: Bearer <key>'")
        found = self._ids.get(hashlib.sha256(token.strip().encode()).digest())
        if found is None:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return found


def check_auth_settings(settings: FrontendSettings, host: str | None = None, service: str = "") -> None:
    """Without keys: refuse a non-loopback address (`host`, else the frontend's own) unless explicitly
    allowed; warn either way. `service` names what is served there (the HTTP API's own address)."""
    if settings.api_keys:
        return
    host = settings.host if host is None else host
    if refusal := no_auth_refusal(settings.api_keys, settings.allow_no_auth, host, service):
        raise SystemExit(refusal)
    log.warning("no API keys configured: serving%s WITHOUT authentication on %s", f" {service}" if service else "",
                host)
