"""Which session holds which history: the index behind automatic session matching.

Entries keyed by a history digest (services/http/conversation.py), expiring with the sessions (the
store's session TTL, refreshed at every turn):
  tip:<digest>   the idle session whose whole history has this digest, with its context length in tokens.
                 Taking it is atomic (`claim`), so two requests with the same history never share a turn:
                 the second finds no tip and opens a session of its own.
  turn:<digest>  a session whose first `turns` logged turns have this digest: where a diverging request
                 copies the matching part of its history from (answer token ids included).
And per API key, its sessions with a tip, least recently used first (`recent:<key>`, with each one's
tip digest in `tips:<key>`): when the key is at its session quota, the least recently used idle one is
taken out (`evict`) and closed, so that stateless clients keep working within the quota.
In Redis they live under the store's prefix (`P http:...`); with the in-process store, in this process.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol, TypeVar

from ..common.redis_store import RedisStore
from ..common.store import MemoryStore, Store

EVICT_CANDIDATES = 16                      # least recently used sessions looked at per eviction
T = TypeVar("T")


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

    def publish(self, owner: str, digests: list[str], tip: Tip) -> None:
        """The session's history after a turn: `digests[j]` (j >= 1) is its first j turns; the last is its
        tip. The session becomes its owner's most recently used."""

    def source(self, digest: str) -> Source | None: ...

    def evict(self, owner: str) -> str | None:
        """Take the owner's least recently used idle session out of the index; its id (to close), or None."""


def _evict(index: SessionIndex, candidates: list[tuple[str, str | None]], forget) -> str | None:
    """The first candidate (session id, tip digest) whose tip is still its own and idle; every candidate
    looked at leaves the recency list (a busy one comes back when its turn publishes)."""
    for session_id, digest in candidates:
        forget(session_id)
        if digest is None:
            continue
        tip = index.claim(digest)
        if tip is not None and tip.session_id == session_id:
            return session_id
        if tip is not None:                # the digest has moved on to another session: not ours to take
            index.release(digest, tip)
    return None


class MemoryIndex:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[object, float]] = {}
        self._recent: dict[str, OrderedDict[str, tuple[str, float]]] = {}   # owner -> session -> (tip, expiry)

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

    def publish(self, owner: str, digests: list[str], tip: Tip) -> None:
        with self._lock:
            now = time.monotonic()
            for key in [k for k, (_, expiry) in self._entries.items() if expiry <= now]:
                del self._entries[key]
            for turns, d in enumerate(digests[1:], 1):
                self._put("turn:" + d, Source(tip.session_id, turns))
            self._put("tip:" + digests[-1], tip)
            recent = self._recent.setdefault(owner, OrderedDict())
            recent.pop(tip.session_id, None)
            recent[tip.session_id] = (digests[-1], now + self.ttl_s)

    def source(self, digest: str) -> Source | None:
        with self._lock:
            return self._get("turn:" + digest)

    def evict(self, owner: str) -> str | None:
        with self._lock:
            now = time.monotonic()
            recent = self._recent.get(owner, OrderedDict())
            candidates = [(sid, d) for sid, (d, expiry) in recent.items() if expiry > now][:EVICT_CANDIDATES]
        return _evict(self, candidates, lambda sid: self._forget(owner, sid))

    def _forget(self, owner: str, session_id: str) -> None:
        with self._lock:
            self._recent.get(owner, {}).pop(session_id, None)


class RedisIndex:
    def __init__(self, store: RedisStore):
        self.redis = store.redis
        self.prefix = store.prefix + "http:"
        self.ttl_ms = store.session_ttl_ms

    def claim(self, digest: str) -> Tip | None:
        raw = self.redis.getdel(self.prefix + "tip:" + digest)
        return Tip(**json.loads(raw)) if raw else None

    def release(self, digest: str, tip: Tip) -> None:
        self.redis.set(self.prefix + "tip:" + digest, json.dumps(asdict(tip)), px=self.ttl_ms, nx=True)

    def publish(self, owner: str, digests: list[str], tip: Tip) -> None:
        recent, tips = self.prefix + "recent:" + owner, self.prefix + "tips:" + owner
        with self.redis.pipeline(transaction=False) as pipe:
            for turns, d in enumerate(digests[1:], 1):
                pipe.set(self.prefix + "turn:" + d, json.dumps([tip.session_id, turns]), px=self.ttl_ms)
            pipe.set(self.prefix + "tip:" + digests[-1], json.dumps(asdict(tip)), px=self.ttl_ms)
            pipe.zadd(recent, {tip.session_id: time.time()})
            pipe.hset(tips, tip.session_id, digests[-1])
            for key in (recent, tips):
                pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

    def source(self, digest: str) -> Source | None:
        raw = self.redis.get(self.prefix + "turn:" + digest)
        return Source(*json.loads(raw)) if raw else None

    def evict(self, owner: str) -> str | None:
        recent, tips = self.prefix + "recent:" + owner, self.prefix + "tips:" + owner
        ids = [i.decode() for i in self.redis.zrange(recent, 0, EVICT_CANDIDATES - 1)]
        digests = self.redis.hmget(tips, ids) if ids else []
        candidates = [(sid, d.decode() if d is not None else None) for sid, d in zip(ids, digests, strict=True)]

        def forget(session_id: str) -> None:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(recent, session_id)
                pipe.hdel(tips, session_id)
                pipe.execute()

        return _evict(self, candidates, forget)


def beside(store: Store, in_memory: Callable[[MemoryStore], T], in_redis: Callable[[RedisStore], T]) -> T:
    """What the HTTP API keeps beside `store`: in Redis for a RedisStore, in this process for the in-process
    store."""
    if isinstance(store, RedisStore):
        return in_redis(store)
    if isinstance(store, MemoryStore):
        return in_memory(store)
    raise TypeError(f"the HTTP API keeps nothing beside a {type(store).__name__}")


def make_index(store: Store) -> SessionIndex:
    """The index beside `store`."""
    return beside(store, lambda s: MemoryIndex(s.session_ttl_s), RedisIndex)
