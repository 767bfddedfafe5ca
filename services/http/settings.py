"""Settings of the HTTP frontend (what it shares with the gRPC frontend, keys and limits included, comes
from FrontendSettings)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HttpSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    image_urls: bool = False              # fetch http(s) image URLs (the server then requests what clients name)
    image_fetch_timeout_s: float = 10.0
    threads: int = 64                     # blocking calls into the frontend at once (a streaming answer holds one)
    sglang_max_new_tokens: int = 128      # SGLang's default, for /generate requests that do not say
