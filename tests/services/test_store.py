"""The in-process store and the Redis store behave alike (records, turn logs, blobs, expiry)."""

from __future__ import annotations

import time

import pytest

from services.common.store import MemoryStore, QuotaError, SessionRecord, TurnRecord, WorkerInfo, digest
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


def _keys(store, session_id: str) -> set[str]:
    """The session's keys in Redis, or what the in-process store holds for it."""
    if isinstance(store, MemoryStore):
        return {k for k, held in (("record", store.session(session_id)), ("turns", store.turns(session_id)))
                if held}
    return {k.decode()[len(store.prefix):] for k in store.redis.scan_iter(match=f"{store.prefix}session:{session_id}*")}


def test_nothing_written_after_close_brings_a_session_back(store):
    store.create_session(SessionRecord("s1", "owner", "tiny", "w1", {}, "colocated"))
    image = b"\x89PNG one"
    turn = TurnRecord("what is this ?", [digest(image)], [], [5], "a", "stop")
    assert store.append_turn("s1", turn, {digest(image): image}) == 1
    store.close_session("s1")
    # a relay's log of the cancelled turn, a rebuild's new worker, a drain's takeover: all after the close
    assert store.append_turn("s1", turn, {digest(image): image}) == 0
    store.set_session_worker("s1", "w2")
    assert not store.detach_session("s1", "w1")
    record = store.session("s1")
    assert record.closed and record.worker_id == "w1" and record.turns == 0 and store.turns("s1") == []
    assert store.blob(digest(image)) is None
    expected = {"record"} if isinstance(store, MemoryStore) else {"session:s1"}
    assert _keys(store, "s1") == expected
    if not isinstance(store, MemoryStore):
        assert 0 < store.redis.pttl(f"{store.prefix}session:s1") <= store.closed_ttl_ms
        assert not list(store.redis.scan_iter(match=f"{store.prefix}blob:*"))
    assert store.append_turn("never-opened", turn) == 0 and store.session("never-opened") is None


def test_a_closed_sessions_images_go_unless_another_session_logged_them(store):
    shared, own = b"\x89PNG shared", b"\x89PNG own"
    for sid in ("a", "b"):
        store.create_session(SessionRecord(sid, "owner", "tiny", "w1", {}, "colocated"))
    store.append_turn("a", TurnRecord("x", [digest(shared), digest(own)], [], [1], "a", "stop"),
                      {digest(shared): shared, digest(own): own})
    store.put_blob(shared)                                   # stored apart, then logged by name only
    store.append_turn("b", TurnRecord("y", [], [[digest(shared)]], [1], "a", "stop"))
    store.close_session("a")
    assert store.blob(digest(own)) is None and store.blob(digest(shared)) == shared
    store.close_session("b")
    assert store.blob(digest(shared)) is None


def test_unclaimed_blobs_lapse():
    store = MemoryStore(unclaimed_blob_ttl_s=0.2)
    key = store.put_blob(b"nobody logs this")
    assert store.blob(key) == b"nobody logs this"
    time.sleep(0.3)
    assert store.blob(key) is None and store.put_blob(b"x") and store.blob_bytes == 1


def test_twenty_closed_sessions_leave_no_image_bytes_behind():
    """Each sends a distinct 3 MiB image and closes: the in-process store keeps none of them."""
    store = MemoryStore()
    peak = 0
    for i in range(20):
        sid = f"s{i}"
        image = i.to_bytes(4, "big") * (3 * 1024 * 1024 // 4)
        store.create_session(SessionRecord(sid, "owner", "tiny", "w1", {}, "colocated"))
        store.append_turn(sid, TurnRecord("x", [digest(image)], [], [1], "a", "stop"), {digest(image): image})
        peak = max(peak, store.blob_bytes)
        store.close_session(sid)
    assert peak == 3 * 1024 * 1024 and store.blob_bytes == 0


def test_memory_store_budget_drops_least_recent_blobs_unclaimed_first():
    store = MemoryStore(max_blob_bytes=10)
    store.create_session(SessionRecord("s", "owner", "tiny", "w1", {}, "colocated"))
    claimed, loose = b"c" * 4, b"l" * 4
    store.append_turn("s", TurnRecord("x", [digest(claimed)], [], [1], "a", "stop"), {digest(claimed): claimed})
    store.put_blob(loose)
    store.put_blob(b"n" * 4)                                  # 12 bytes > 10: the unclaimed one goes first
    assert store.blob(digest(loose)) is None and store.blob(digest(claimed)) == claimed
    store.put_blob(b"m" * 4)                                  # unclaimed ones first, even newer ones
    assert store.blob(digest(b"n" * 4)) is None and store.blob(digest(claimed)) == claimed
    big = b"b" * 8
    store.append_turn("s", TurnRecord("y", [digest(big)], [], [1], "a", "stop"), {digest(big): big})
    assert store.blob(digest(b"m" * 4)) is None and store.blob(digest(claimed)) is None   # then claimed ones
    assert store.blob(digest(big)) == big and store.blob_bytes == 8


def test_open_session_quota_per_owner(store):
    def record(sid: str, owner: str = "alice") -> SessionRecord:
        return SessionRecord(sid, owner, "tiny", "w1", {}, "colocated")

    store.create_session(record("a1"), limit=2)
    store.create_session(record("a2"), limit=2)
    with pytest.raises(QuotaError, match="2 open sessions"):
        store.create_session(record("a3"), limit=2)
    assert store.session("a3") is None and store.open_sessions("alice") == 2
    store.create_session(record("b1", "bob"), limit=2)           # another key is not affected
    store.append_turn("a1", TurnRecord("x", [], [], [1], "a", "stop"))
    store.close_session("a2")
    store.create_session(record("a3"), limit=2)                  # a closed one no longer counts
    assert store.open_sessions("alice") == 2 and store.open_sessions("bob") == 1
    store.create_session(record("a4"))                           # no limit given: not counted against
    assert store.open_sessions("alice") == 3


def test_running_turn_quota_per_owner_with_leases(store):
    store.begin_turn("alice", "s/0", limit=2, lease_s=60)
    store.begin_turn("alice", "t/0", limit=2, lease_s=0.2)
    with pytest.raises(QuotaError, match="2 turns running"):
        store.begin_turn("alice", "u/0", limit=2, lease_s=60)
    store.begin_turn("bob", "v/0", limit=2, lease_s=60)
    store.end_turn("alice", "s/0")
    store.begin_turn("alice", "u/0", limit=2, lease_s=60)
    time.sleep(0.3)                                               # t/0's lease lapsed (its frontend died)
    store.begin_turn("alice", "w/0", limit=2, lease_s=60)
    with pytest.raises(QuotaError):
        store.begin_turn("alice", "x/0", limit=2, lease_s=60)
