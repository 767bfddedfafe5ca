"""What must outlive one process: worker registrations, session records, turn logs, image blobs.

`Store` is the interface; `MemoryStore` (here) serves the embedded default, in one process, and
`RedisStore` (redis_store.py, which builds on this module and is never imported by it) is shared by
several frontends and workers; services/launch.py picks one from the settings. Key schema:
docs/services.md.

Closing is final: once a session is closed (or has expired), nothing written for it afterwards (a turn
logged by a relay that raced the close, a new worker) brings its keys back. Image blobs belong to the
sessions whose logged turns name them: a blob is kept while one of them is open, dropped when the last
one closes or expires, and a blob no logged turn claims lapses after `unclaimed_blob_ttl_s`.

Quotas (per owner, i.e. API key id): `create_session` with a limit refuses an owner's session past
`limit` open ones (`QuotaError`), and `begin_turn` / `end_turn` count an owner's running turns, each
as a lease that lapses after `lease_s` (a frontend that dies mid-turn does not hold a slot forever).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class WorkerInfo:
    """A decode worker as registered: where to reach it and how loaded it is."""

    worker_id: str
    address: str
    model: str
    recovery_modes: list[str]
    sessions: int = 0
    active_turns: int = 0
    free_pages: int = 0
    total_pages: int = 0
    started_at: float = 0.0    # when it loaded its model (seconds since the epoch)


@dataclass
class SessionRecord:
    session_id: str
    owner: str                 # the creating API key's id ("" without auth)
    model: str
    worker_id: str             # the worker holding its cache (affinity); "": detached, taken over at its next turn
    deferral: dict             # DeferralSettings as a JSON object (the worker's effective settings)
    recovery_mode: str         # colocated | disaggregated
    created_at: float = field(default_factory=time.time)
    closed: bool = False
    turns: int = 0             # length of its turn log (filled on read)


@dataclass
class TurnRecord:
    """One completed turn: the message by content (images by hash; their bytes are blobs) and the answer."""

    text: str
    images: list[str]                  # sha256 hex of each image's bytes
    videos: list[list[str]]            # per video, sha256 hex of each frame
    answer_token_ids: list[int]
    answer_text: str
    finish_reason: str
    created_at: float = field(default_factory=time.time)
    render: dict = field(default_factory=dict)   # the message's RenderOptions as JSON ({}: the defaults)


class QuotaError(Exception):
    """An owner is at its limit of open sessions or running turns."""


class Store(Protocol):
    def register_worker(self, info: WorkerInfo, ttl_s: float) -> None:
        """Create or refresh a registration; it lapses `ttl_s` after the last call."""

    def remove_worker(self, worker_id: str) -> None: ...

    def workers(self) -> list[WorkerInfo]:
        """Live registrations."""

    def worker(self, worker_id: str) -> WorkerInfo | None: ...

    def create_session(self, record: SessionRecord, limit: int | None = None) -> None:
        """Record a new session; with `limit`, QuotaError if its owner has that many open already."""

    def open_sessions(self, owner: str) -> int:
        """How many sessions of `owner` are open (neither closed nor expired)."""

    def begin_turn(self, owner: str, turn_id: str, limit: int, lease_s: float) -> None:
        """Count a running turn of `owner` (until `end_turn`, or `lease_s`); QuotaError at `limit`."""

    def end_turn(self, owner: str, turn_id: str) -> None: ...

    def session(self, session_id: str) -> SessionRecord | None:
        """The record (closed ones too, for a while), with `turns` filled; None if unknown or expired."""

    def set_session_worker(self, session_id: str, worker_id: str) -> None: ...

    def detach_session(self, session_id: str, worker_id: str) -> bool:
        """Mark the session for takeover (worker_id ""), if `worker_id` still holds it; True if it did."""

    def close_session(self, session_id: str) -> None:
        """Mark closed and drop the turn log; the record lingers so later calls can say it was closed."""

    def append_turn(self, session_id: str, turn: TurnRecord, blobs: Mapping[str, bytes] | None = None) -> int:
        """Log a completed turn, store `blobs` (digest -> bytes) with it, and refresh the session's expiry;
        returns the number of turns. A closed or unknown session is left alone and 0 is returned."""

    def turns(self, session_id: str) -> list[TurnRecord]: ...

    def put_blob(self, data: bytes) -> str:
        """Store bytes by content; returns their sha256 hex. Unclaimed until a logged turn names it."""

    def blob(self, digest: str) -> bytes | None: ...

    def close(self) -> None: ...


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class MemoryStore:
    """The in-process `Store`: same semantics as RedisStore, expiry included. Image bytes are capped at
    `max_blob_bytes`: past it the least recently stored blobs are dropped (unclaimed ones first), and a
    rebuild that needed one fails with DATA_LOSS."""

    def __init__(self, session_ttl_s: float = 86400.0, closed_ttl_s: float = 3600.0, *,
                 max_blob_bytes: int = 256 * 1024 * 1024, unclaimed_blob_ttl_s: float = 600.0):
        self.session_ttl_s = session_ttl_s
        self.closed_ttl_s = closed_ttl_s
        self.max_blob_bytes = max_blob_bytes
        self.unclaimed_blob_ttl_s = unclaimed_blob_ttl_s
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[WorkerInfo, float]] = {}
        self._sessions: dict[str, tuple[SessionRecord, float]] = {}
        self._turns: dict[str, list[TurnRecord]] = {}
        # digest -> (bytes, expiry of an unclaimed blob); insertion order = least recently stored first
        self._blobs: dict[str, tuple[bytes, float]] = {}
        self._claims: dict[str, set[str]] = {}     # digest -> open sessions whose logged turns name it
        self._blob_bytes = 0
        self._running: dict[str, dict[str, float]] = {}   # owner -> running turn id -> lease expiry

    def register_worker(self, info: WorkerInfo, ttl_s: float) -> None:
        with self._lock:
            self._workers[info.worker_id] = (info, time.monotonic() + ttl_s)

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def workers(self) -> list[WorkerInfo]:
        now = time.monotonic()
        with self._lock:
            return [info for info, expiry in self._workers.values() if expiry > now]

    def worker(self, worker_id: str) -> WorkerInfo | None:
        entry = self._workers.get(worker_id)
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def create_session(self, record: SessionRecord, limit: int | None = None) -> None:
        with self._lock:
            self._sweep()
            if limit is not None and self._open_sessions(record.owner) >= limit:
                raise QuotaError(f"this API key has {limit} open sessions, the limit: close one first")
            self._sessions[record.session_id] = (dataclasses.replace(record), time.monotonic() + self.session_ttl_s)
            self._turns[record.session_id] = []

    def open_sessions(self, owner: str) -> int:
        with self._lock:
            return self._open_sessions(owner)

    def _open_sessions(self, owner: str) -> int:
        now = time.monotonic()
        return sum(r.owner == owner and not r.closed and e > now for r, e in self._sessions.values())

    def begin_turn(self, owner: str, turn_id: str, limit: int, lease_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            running = {t: e for t, e in self._running.get(owner, {}).items() if e > now}
            if len(running) >= limit:
                raise QuotaError(f"this API key has {limit} turns running, the limit: wait for one to end")
            running[turn_id] = now + lease_s
            self._running[owner] = running

    def end_turn(self, owner: str, turn_id: str) -> None:
        with self._lock:
            running = self._running.get(owner, {})
            running.pop(turn_id, None)
            if not running:
                self._running.pop(owner, None)

    def _sweep(self) -> None:
        """Forget what has expired (Redis does this by itself)."""
        now = time.monotonic()
        for sid in [sid for sid, (_, expiry) in self._sessions.items() if expiry <= now]:
            del self._sessions[sid]
            self._release(sid)
        for key in [key for key, (_, expiry) in self._blobs.items() if expiry <= now and not self._claims.get(key)]:
            self._drop_blob(key)

    def _live(self, session_id: str) -> SessionRecord | None:
        entry = self._sessions.get(session_id)
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def session(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            record = self._live(session_id)
            if record is None:
                return None
            return dataclasses.replace(record, turns=len(self._turns.get(session_id, [])))

    def set_session_worker(self, session_id: str, worker_id: str) -> None:
        with self._lock:
            record = self._live(session_id)
            if record is not None and not record.closed:
                record.worker_id = worker_id

    def detach_session(self, session_id: str, worker_id: str) -> bool:
        with self._lock:
            record = self._live(session_id)
            if record is None or record.closed or record.worker_id != worker_id:
                return False
            record.worker_id = ""
            return True

    def close_session(self, session_id: str) -> None:
        with self._lock:
            record = self._live(session_id)
            if record is not None:
                record.closed = True
                self._sessions[session_id] = (record, time.monotonic() + self.closed_ttl_s)
                self._release(session_id)

    def _release(self, session_id: str) -> None:
        """The session's turn log goes, and with it its claims on blobs (dropped when nobody else has one)."""
        for turn in self._turns.pop(session_id, []):
            for key in _turn_blobs(turn):
                holders = self._claims.get(key)
                if holders is not None:
                    holders.discard(session_id)
                    if not holders:
                        del self._claims[key]
                        self._drop_blob(key)

    def append_turn(self, session_id: str, turn: TurnRecord, blobs: Mapping[str, bytes] | None = None) -> int:
        with self._lock:
            record = self._live(session_id)
            if record is None or record.closed:
                return 0
            for data in (blobs or {}).values():
                self._store_blob(data)
            log = self._turns.setdefault(session_id, [])
            log.append(turn)
            for key in _turn_blobs(turn):
                self._claims.setdefault(key, set()).add(session_id)
            self._sessions[session_id] = (record, time.monotonic() + self.session_ttl_s)
            return len(log)

    def turns(self, session_id: str) -> list[TurnRecord]:
        with self._lock:
            return list(self._turns.get(session_id, []))

    def put_blob(self, data: bytes) -> str:
        with self._lock:
            self._sweep()
            return self._store_blob(data)

    def _store_blob(self, data: bytes) -> str:
        key = digest(data)
        self._drop_blob(key)                     # stored again: now the most recent
        self._blobs[key] = (bytes(data), time.monotonic() + self.unclaimed_blob_ttl_s)
        self._blob_bytes += len(data)
        # over the budget: drop the least recently stored, unclaimed ones first, never the one just stored
        for claimed in (False, True):
            for old in [k for k in self._blobs if k != key and bool(self._claims.get(k)) == claimed]:
                if self._blob_bytes <= self.max_blob_bytes:
                    return key
                self._drop_blob(old)
        return key

    def _drop_blob(self, key: str) -> None:
        entry = self._blobs.pop(key, None)
        if entry is not None:
            self._blob_bytes -= len(entry[0])

    def blob(self, digest: str) -> bytes | None:
        with self._lock:
            entry = self._blobs.get(digest)
            if entry is None or (entry[1] <= time.monotonic() and not self._claims.get(digest)):
                return None
            return entry[0]

    @property
    def blob_bytes(self) -> int:
        """Image bytes held now (at most `max_blob_bytes`, or one blob larger than it)."""
        return self._blob_bytes

    def close(self) -> None:
        pass


def _turn_blobs(turn: TurnRecord) -> list[str]:
    return [*turn.images, *(frame for video in turn.videos for frame in video)]

