"""Admission control: cheap checks before costly work, per-key quotas, idle sessions that yield to others,
new sessions that avoid a worker that just died, and error messages that do not echo unbounded input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raincheck_client import InvalidArgument, NotFound, ResourceExhausted, Token
from services.common.store import MemoryStore
from tests.multimodal.mm_helpers import huge_png, png
from tests.services.conftest import redis_store

ANSWER = dict(max_new_tokens=4, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keyed(cluster):
    store = MemoryStore()
    worker = cluster.worker(store)
    frontend = cluster.frontend(store, api_keys=("alice", "bob"), max_sessions_per_key=2, max_turns_per_key=1,
                                max_message_pixels=3 * 1024 * 1024)
    return cluster, frontend, worker


@pytest.mark.parametrize(("send", "message"), [
    (dict(text="x" * 6_000_000), "the text has 6000000 characters; the limit is 262144"),
    (dict(text="what is this ?", images=[huge_png()]), "image 0 is 9000x9000 pixels; the limit is 16777216"),
    (dict(text="hi", videos=[[png(), huge_png(4200, 4200)]]), "video 0 frame 1 is 4200x4200 pixels"),
    (dict(text="hi", images=[huge_png(1024, 1024)] * 4), "4194304 pixels in all; the limit is 3145728"),
    (dict(text="hi", images=[b"\x89PNG\r\n\x1a\n not really"]), r"image 0 \(19 bytes\) could not be decoded as an"),
])
def test_cheap_checks_refuse_before_any_work(keyed, send, message):
    cluster, frontend, worker = keyed
    session = cluster.client(frontend, "alice").create_session()
    with pytest.raises(InvalidArgument, match=message):
        session.send(**send).text()
    assert worker.runtime.sessions[session.id].session.turns == 0      # the worker never saw the turn


def test_huge_session_id_is_not_found_with_a_bounded_echo(keyed):
    cluster, frontend, _ = keyed
    client = cluster.client(frontend, "alice")
    with pytest.raises(NotFound) as caught:
        client.session("a" * (1024 * 1024))
    message = str(caught.value)
    assert "does not exist" in message and "(1048576 characters)" in message and len(message) < 300


def test_open_sessions_per_key(keyed):
    cluster, frontend, _ = keyed
    alice, bob = cluster.client(frontend, "alice"), cluster.client(frontend, "bob")
    first, _second = alice.create_session(), alice.create_session()
    with pytest.raises(ResourceExhausted, match="2 open sessions, the limit"):
        alice.create_session()
    bob.create_session()                          # another key is not affected
    first.close()
    alice.create_session().send("hi", **ANSWER).text()


def test_running_turns_per_key(keyed):
    cluster, frontend, _ = keyed
    alice, bob = cluster.client(frontend, "alice"), cluster.client(frontend, "bob")
    a1, a2 = alice.create_session(), alice.create_session()
    long = iter(a1.send("what is this ?", max_new_tokens=300, ignore_eos=True))
    assert isinstance(next(long), Token)
    with pytest.raises(ResourceExhausted, match="1 turns running, the limit"):
        a2.send("hi", **ANSWER).text()
    bob.create_session().send("hi", **ANSWER).text()
    a1.cancel()
    list(long)                                    # its stream ended: the key's turn slot is free again
    a2.send("hi", **ANSWER).text()


def test_idle_sessions_yield_their_state_slots_from_the_key_holding_most(cluster):
    """A worker with 3 GDN state slots: alice's idle sessions fill them, yet bob's new session opens
    (alice's least recently used one is freed), and alice's freed session is rebuilt at its next turn with
    the same answer as a session that never moved."""
    store = MemoryStore()
    worker = cluster.worker(store, engine={"max_gdn_slots": 3})
    frontend = cluster.frontend(store, api_keys=("alice", "bob"))
    alice, bob = cluster.client(frontend, "alice"), cluster.client(frontend, "bob")
    turns = [("what is this ?", [png()]), ("and the blue one ?", [])]
    sessions = [alice.create_session(policy="full") for _ in range(3)]
    answers = [[s.send(t, images=i, **ANSWER).result().token_ids for t, i in turns[:1]] for s in sessions]
    oldest = sessions[0]

    bob.create_session().send("hi", **ANSWER).text()
    assert oldest.id not in worker.runtime.sessions and len(worker.runtime.sessions) == 3
    for session, got in zip(sessions, answers, strict=True):
        got.append(session.send(turns[1][0], **ANSWER).result().token_ids)
    assert all(got == answers[1] for got in answers)     # same dialogue, same answers, rebuilt or not
    assert oldest.status().turns == 2


def test_new_sessions_skip_a_worker_that_just_died(cluster, redis_prefix):
    """A crashed worker stays registered until its registration lapses; sessions created meanwhile go
    elsewhere (the first attempt on it fails, the frontend retries and passes it over afterwards)."""
    workers = [cluster.worker(redis_store(redis_prefix)) for _ in range(2)]
    frontend = cluster.frontend(redis_store(redis_prefix))
    client = cluster.client(frontend)
    busy = client.create_session()                 # the other worker, least loaded, is the one that dies
    alive, dead = sorted(workers, key=lambda w: w.worker_id != busy.info.worker_id)
    dead._stopping.set()                           # no more heartbeats: as if killed -9
    dead.server.stop(0).wait()
    assert dead.worker_id in {w.worker_id for w in redis_store(redis_prefix).workers()}
    for _ in range(4):
        session = client.create_session()
        assert session.info.worker_id == alive.worker_id
        session.send("hi", **ANSWER).text()


def test_oversized_requests_are_refused_before_using_100_mb(checkpoint):
    """Once 2.4 GB of peak memory (the 9000x9000 PNG was decoded, then downscaled) and, for 6 M characters,
    a tokenized and embedded prompt. Measured in a process of its own (tests/services/memory_probe.py)."""
    probe = subprocess.run([sys.executable, "-m", "tests.services.memory_probe", str(checkpoint)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    for case in ("png_9000x9000", "text_6M_chars"):
        assert result[case]["code"] == "INVALID_ARGUMENT", result
        assert result[case]["peak_growth_mb"] < 100, result
