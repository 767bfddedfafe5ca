"""Which session holds which history: the index behind automatic session matching.

Two kinds of entry, both keyed by a history digest (services/http/conversation.py) and expiring with
the sessions (the store's session TTL, refreshed at every turn):
  tip:<digest>   the idle session whose whole history has this digest, with its context length in tokens.
                 Taking it is atomic (`claim`), so two requests with the same history never share a turn:
                 the second finds no tip and opens a session of its own.
  turn:<digest>  a session whose first `turns` logged turns have this digest: where a diverging request
                 copies the matching part of its history from (answer token ids included).
In Redis they live under the store's prefix (`P http:tip:<digest>`, `P http:turn:<digest>`); with the
in-process store, in this process.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ..common.redis_store import RedisStore
from ..common.store import MemoryStore, Store


@dataclass(frozen=True)
class Tip:
    session_id: str
    context_tokens: int                    # tokens the session holds (its cache), for usage.cached_tokens


@dataclass(frozen=True)
class Source:
    session_id: str
    turns: int


class SessionIndex(Protocol):
    def claim(self, digest: str) -> Tip | None:
        """Take the tip: afterwards no other request finds it (until `publish` or `release`)."""

    def release(self, digest: str, tip: Tip) -> None:
        """Put back a claimed tip whose turn did not start (unless another tip took its place)."""

    def publish(self, digests: list[str], tip: Tip) -> None:
        """The session's history after a turn: `digests[j]` (j >= 1) is its first j turns; the last is its tip."""

    def source(self, digest: str) -> Source | None: ...


class MemoryIndex:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[object, float]] = {}

    def _get(self, key: str, pop: bool = False):
        entry = self._entries.pop(key, None) if pop else self._entries.get(key)
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def _put(self, key: str, value: object) -> None:
        self._entries[key] = (value, time.monotonic() + self.ttl_s)

    def claim(self, digest: str) -> Tip | None:
        with self._lock:
            return self._get("tip:" + digest, pop=True)

    def release(self, digest: str, tip: Tip) -> None:
        with self._lock:
            if self._get("tip:" + digest) is None:
                self._put("tip:" + digest, tip)

    def publish(self, digests: list[str], tip: Tip) -> None:
        with self._lock:
            now = time.monotonic()
            for key in [k for k, (_, expiry) in self._entries.items() if expiry <= now]:
                del self._entries[key]
            for turns, d in enumerate(digests[1:], 1):
                self._put("turn:" + d, Source(tip.session_id, turns))
            self._put("tip:" + digests[-1], tip)

    def source(self, digest: str) -> Source | None:
        with self._lock:
            return self._get("turn:" + digest)


class RedisIndex:
    def __init__(self, store: RedisStore):
        self.redis = store.redis
        self.prefix = store.prefix + "http:"
        self.ttl_ms = store.session_ttl_ms

    def claim(self, digest: str) -> Tip | None:
        raw = self.redis.getdel(self.prefix + "tip:" + digest)
        return Tip(**json.loads(raw)) if raw else None

    def release(self, digest: str, tip: Tip) -> None:
        self.redis.set(self.prefix + "tip:" + digest, json.dumps(tip.__dict__), px=self.ttl_ms, nx=True)

    def publish(self, digests: list[str], tip: Tip) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for turns, d in enumerate(digests[1:], 1):
                pipe.set(self.prefix + "turn:" + d, json.dumps([tip.session_id, turns]), px=self.ttl_ms)
            pipe.set(self.prefix + "tip:" + digests[-1], json.dumps(tip.__dict__), px=self.ttl_ms)
            pipe.execute()

    def source(self, digest: str) -> Source | None:
        raw = self.redis.get(self.prefix + "turn:" + digest)
        return Source(*json.loads(raw)) if raw else None


def make_index(store: Store) -> SessionIndex:
    """The index beside `store`: in Redis for a RedisStore, in this process for the in-process store."""
    if isinstance(store, RedisStore):
        return RedisIndex(store)
    if isinstance(store, MemoryStore):
        return MemoryIndex(store.session_ttl_s)
    raise TypeError(f"no session index for a {type(store).__name__}")
