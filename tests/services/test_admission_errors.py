"""The caches raise typed page errors, and admission tells them apart by type, never by their text: a
session's own page budget frees nobody, every GDN slot taken (or a pool short of what it could hold)
frees an idle session and retries."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from raincheck_core.cache.gdn_state import GDNStatePool
from raincheck_core.cache.kv_pool import KVPool, PageTable
from raincheck_core.errors import (
    GDNSlotsExhaustedError,
    OutOfPagesError,
    RequestTooLargeError,
    SessionPageBudgetError,
)
from services.decode_worker.eviction import admit


def test_the_caches_raise_the_typed_errors():
    pool = KVPool(1, 4, 4, 1, 2, torch.float32, "cpu")
    with pytest.raises(SessionPageBudgetError):
        PageTable(pool, max_pages=1).reserve(5)
    PageTable(pool, max_pages=4).reserve(16)
    with pytest.raises(OutOfPagesError) as shared:
        PageTable(pool, max_pages=4).reserve(1)
    assert not isinstance(shared.value, (SessionPageBudgetError, GDNSlotsExhaustedError))
    slots = GDNStatePool(1, 1, 4, 4, 1, 2, 2, torch.float32, "cpu")
    slots.allocate()
    with pytest.raises(GDNSlotsExhaustedError):
        slots.allocate()


class _Runtime:
    """What `admit` reads of a worker: the pool's size, its sessions (one idle) and their closing."""

    def __init__(self, total_pages: int = 64):
        self.engine = SimpleNamespace(pool_stats=lambda: SimpleNamespace(total_pages=total_pages))
        self.sessions = {"idle": SimpleNamespace(id="idle", owner="alice", last_used=0.0, lock=threading.Lock(),
                                                 active=False, recovery_mode="colocated")}
        self.backends = {"colocated": SimpleNamespace(pending=lambda ws: 0)}
        self.closed: list[str] = []

    def close(self, session_id: str) -> None:
        self.closed.append(session_id)
        del self.sessions[session_id]


def _failing_once(error: OutOfPagesError):
    calls = []

    def action() -> str:
        calls.append(error)
        if len(calls) == 1:
            raise error
        return "admitted"
    return action


@pytest.mark.parametrize("error", [
    GDNSlotsExhaustedError("no slot", needed=1, available=0),
    # the shared pool, whatever the message says: only the type marks a session's own budget
    OutOfPagesError("session page budget exceeded", needed=8, available=2),
], ids=["gdn-slots", "pool"])
def test_a_shared_shortage_frees_an_idle_session_and_retries(error):
    runtime = _Runtime()
    assert admit(runtime, _failing_once(error)) == "admitted"
    assert runtime.closed == ["idle"]


def test_a_gdn_slot_shortage_frees_a_session_whatever_needed_says():
    """`needed` counts slots there, not pages: no comparison with the page pool's size applies."""
    runtime = _Runtime(total_pages=1)
    assert admit(runtime, _failing_once(GDNSlotsExhaustedError("no slot", needed=2, available=0))) == "admitted"
    assert runtime.closed == ["idle"]


@pytest.mark.parametrize("error", [
    SessionPageBudgetError("over", needed=8, available=4),
    OutOfPagesError("KV page pool exhausted", needed=65, available=3),     # more than the whole pool
], ids=["own-budget", "beyond-the-pool"])
def test_what_freeing_cannot_help_is_raised_at_once(error):
    """As a request that can never fit (INVALID_ARGUMENT: no retry helps), not the shortage."""
    runtime = _Runtime()
    with pytest.raises(RequestTooLargeError, match=r"can never fit .*holds 64 pages") as e:
        admit(runtime, _failing_once(error))
    assert runtime.closed == [] and e.value.__cause__ is error


def test_a_shortage_nothing_can_be_freed_for_says_a_retry_can_help():
    runtime = _Runtime()
    runtime.sessions["idle"].active = True       # streaming: never freed
    with pytest.raises(GDNSlotsExhaustedError, match=r"busy .*: retry later: needs 1 GDN state slot, 0 available"):
        admit(runtime, _failing_once(GDNSlotsExhaustedError("no slot", needed=1, available=0)))
