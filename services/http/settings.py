"""Settings of the HTTP frontend, declared like the other services' (services/common/settings.py): each
`setting(...)` field is also a flag with its environment variable. What it shares with the gRPC frontend
(API keys, quotas, message limits, TLS, the store) comes from FrontendSettings."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from ..common.settings import OptionalPort, Port, setting


@dataclass
class HttpSettings:
    host: str = setting("127.0.0.1", "RAINCHECK_HTTP_HOST", "address the HTTP API listens on", flag="--http-host")
    port: Port = setting(8000, "RAINCHECK_HTTP_PORT", "port of the HTTP API: OpenAI /v1/chat/completions, SGLang "
                         "/generate (0: any free port)", flag="--http-port")
    image_urls: bool = setting(False, "RAINCHECK_HTTP_IMAGE_URLS", "fetch http(s) image URLs in requests (the "
                               "server then fetches whatever clients name)", flag="--http-image-urls")
    image_fetch_timeout_s: float = setting(10.0, "RAINCHECK_HTTP_IMAGE_TIMEOUT_S", "time limit of fetching one "
                                           "image URL", flag="--http-image-timeout-s", gt=0)
    allowed_origins: tuple[str, ...] = setting((), "RAINCHECK_HTTP_ALLOWED_ORIGINS", "comma-separated origins whose "
                                               "browser pages may call the HTTP API (CORS; * for any)",
                                               flag="--allowed-origins", shown="none: no CORS headers")
    threads: int = Field(64, gt=0)               # blocking calls into the frontend at once (an answer holds one)
    sglang_max_new_tokens: int = Field(128, gt=0)   # SGLang's default, for /generate requests that do not say


@dataclass
class ServeHttpSettings(HttpSettings):
    """`raincheck serve`'s: the HTTP API is off unless given a port."""

    port: OptionalPort = setting(None, "RAINCHECK_HTTP_PORT", "also serve the HTTP API (OpenAI "
                                 "/v1/chat/completions, SGLang /generate) on this port (0: any free port)",
                                 flag="--http-port", shown="off")
