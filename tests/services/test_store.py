"""The in-process store and the Redis store behave alike (records, turn logs, blobs, expiry)."""

from __future__ import annotations

import time

import pytest

from services.common.store import MemoryStore, SessionRecord, TurnRecord, WorkerInfo, digest
from tests.services.conftest import redis_store


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        s = MemoryStore(session_ttl_s=60, closed_ttl_s=0.3)
    else:
        s = redis_store(request.getfixturevalue("redis_prefix"))
        s.closed_ttl_ms = 300
    yield s
    s.close()


def test_worker_registrations_lapse_without_heartbeats(store):
    store.register_worker(WorkerInfo("w1", "127.0.0.1:1", "tiny", ["colocated"], sessions=2), ttl_s=0.3)
    store.register_worker(WorkerInfo("w2", "127.0.0.1:2", "tiny", ["colocated"]), ttl_s=30)
    assert sorted(w.worker_id for w in store.workers()) == ["w1", "w2"]
    assert store.worker("w1").sessions == 2
    time.sleep(0.4)
    assert [w.worker_id for w in store.workers()] == ["w2"] and store.worker("w1") is None
    store.remove_worker("w2")
    assert store.workers() == [] and store.worker("w2") is None


def test_session_record_turn_log_and_close(store):
    record = SessionRecord("s1", "owner", "tiny", "w1", {"policy": "raincheck", "retention": 0.3}, "colocated")
    store.create_session(record)
    assert store.session("s1") == record and store.session("nope") is None
    turn = TurnRecord("what is this ?", [digest(b"png")], [], [5, 6, 7], "abc", "length")
    assert store.append_turn("s1", turn) == 1
    assert store.append_turn("s1", turn) == 2
    store.set_session_worker("s1", "w2")
    got = store.session("s1")
    assert (got.worker_id, got.turns, got.deferral["retention"]) == ("w2", 2, 0.3)
    assert store.turns("s1") == [turn, turn]
    store.close_session("s1")
    assert store.session("s1").closed and store.turns("s1") == []
    time.sleep(0.4)
    assert store.session("s1") is None       # closed records linger only briefly
    store.set_session_worker("s1", "w3")     # no partial record appears for an expired session
    store.close_session("s1")
    assert store.session("s1") is None


def test_detach_only_by_the_holding_worker(store):
    store.create_session(SessionRecord("s1", "owner", "tiny", "w1", {}, "colocated"))
    assert not store.detach_session("s1", "w2")          # moved on already: left alone
    assert store.session("s1").worker_id == "w1"
    assert store.detach_session("s1", "w1")
    assert store.session("s1").worker_id == "" and not store.detach_session("s1", "w1")
    assert not store.detach_session("nope", "w1")


def test_blobs_by_content(store):
    key = store.put_blob(b"\x89PNG...")
    assert key == digest(b"\x89PNG...") and store.blob(key) == b"\x89PNG..."
    assert store.blob(digest(b"other")) is None
