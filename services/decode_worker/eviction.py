"""Eviction under memory pressure: idle sessions yield their caches to work that needs room.

A worker keeps every open session's KV pages and GDN state slot between turns. When a new session or a
turn cannot be admitted (`OutOfPagesError`: the page pool, or every GDN slot, is taken), the worker frees
idle sessions' caches one at a time and tries again: first those of the API key holding the most
sessions here (so that one key's idle sessions cannot lock the others out), least recently used first.
A freed session stays open in the store; its next turn finds it gone here, and the frontend rebuilds it
on a worker from its turn log, whole history included (replay.py). A session whose turn is streaming, or
whose deferred tokens are still being recovered, is never freed.

Every admission goes through `admit`: sessions opening, turns, and the stateless paths (completions, and
the echo + logprobs scoring forward of /v1/completions: completions.py). What it raises says whether
waiting can help: the shortage again (RESOURCE_EXHAUSTED, an HTTP 429 with Retry-After) when busy sessions
hold what is missing, `RequestTooLargeError` (INVALID_ARGUMENT, a 400) when no wait could make room.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from raincheck_core import OutOfPagesError, RequestTooLargeError, SessionClosedError
from raincheck_core.errors import GDNSlotsExhaustedError, SessionPageBudgetError

from ..common.logs import bind

if TYPE_CHECKING:
    from raincheck_core import Engine

    from .recovery import RecoveryBackend
    from .sessions import WorkerSession

log = logging.getLogger(__name__)
T = TypeVar("T")


class Worker(Protocol):
    """What eviction reads of a worker (its WorkerRuntime): the engine's pool, the sessions held, their
    recovery backends (a session still recovering is never freed), and how a session is closed."""

    engine: Engine
    sessions: dict[str, WorkerSession]
    backends: dict[str, RecoveryBackend]

    def close(self, session_id: str) -> None: ...


def admit(runtime: Worker, action: Callable[[], T], keep: str = "") -> T:
    """`action()`; while it runs out of pool pages or slots, free an idle session (never `keep`) and retry.
    Nothing is freed for what freeing cannot help: more pages than the pool has, or than the session's own
    page budget allows (RequestTooLargeError). With nothing left to free, the shortage is raised again,
    saying that busy sessions hold it (a wait can help)."""
    while True:
        try:
            return action()
        except OutOfPagesError as e:
            if not _shared(runtime, e):
                total = runtime.engine.pool_stats().total_pages
                raise RequestTooLargeError(f"{e}: this can never fit (the worker's KV pool holds {total} pages in "
                                           "all, a session at most its page budget)", limit=e.available,
                                           requested=e.needed) from e
            if not free_one(runtime, keep, str(e)):
                busy = "and the sessions holding them are busy (streaming or recovering): retry later"
                raise type(e)(f"{e.what}, {busy}", needed=e.needed, available=e.available) from e


def _shared(runtime: Worker, error: OutOfPagesError) -> bool:
    """The error is about the worker's shared slots, or its shared pool and the request fits the pool at
    all (a session's own budget is no one else's to free)."""
    if isinstance(error, GDNSlotsExhaustedError):
        return True
    return not isinstance(error, SessionPageBudgetError) and error.needed <= runtime.engine.pool_stats().total_pages


def free_one(runtime: Worker, keep: str, reason: str) -> bool:
    """Close one idle session here (see the module doc for which); False if none can go."""
    sessions = list(runtime.sessions.values())
    held = Counter(ws.owner for ws in sessions)
    for ws in sorted((ws for ws in sessions if ws.id != keep), key=lambda ws: (-held[ws.owner], ws.last_used)):
        with ws.lock:          # no turn of it can start while it is judged and closed
            if ws.active or runtime.backends[ws.recovery_mode].pending(ws):
                continue
            try:
                runtime.close(ws.id)
            except SessionClosedError:   # closed meanwhile
                continue
        bind(log, session_id=ws.id).info("freed an idle session's cache (its key holds %d sessions here): %s",
                                         held[ws.owner], reason)
        return True
    return False
