"""Several frontends and decode workers on one Redis: affinity, least-load routing, restarts, rebuilds."""

from __future__ import annotations

from raincheck_core import Engine, Message, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from tests.multimodal.mm_helpers import png
from tests.services.conftest import redis_store

ANSWER = dict(max_new_tokens=6, ignore_eos=True)


def test_two_frontends_route_a_session_to_its_worker(cluster, redis_prefix):
    w1, w2 = cluster.worker(redis_store(redis_prefix)), cluster.worker(redis_store(redis_prefix))
    f1, f2 = cluster.frontend(redis_store(redis_prefix)), cluster.frontend(redis_store(redis_prefix))
    c1, c2 = cluster.client(f1), cluster.client(f2)
    first = c1.create_session()
    second = c2.create_session()        # least loaded: the other worker
    assert {first.info.worker_id, second.info.worker_id} == {w1.worker_id, w2.worker_id}
    owner = w1 if first.info.worker_id == w1.worker_id else w2

    a = first.send("what is this ?", images=[png()], **ANSWER).result()
    same = c2.session(first.id)         # the other frontend finds it in Redis
    b = same.send("and the blue one ?", **ANSWER).result()
    assert a.turn_id == f"{first.id}/0" and b.turn_id == f"{first.id}/1"
    assert same.status().turns == 2 and same.status().worker_id == owner.worker_id
    assert owner.runtime.sessions[first.id].session.turns == 2


def test_restarted_frontend_keeps_serving(cluster, redis_prefix):
    cluster.worker(redis_store(redis_prefix))
    frontend = cluster.frontend(redis_store(redis_prefix), api_keys=("k",))
    session = cluster.client(frontend, "k").create_session()
    session.send("what is this ?", images=[png()], follow_recovery=True, **ANSWER).text()
    cluster.stop(frontend)

    restarted = cluster.frontend(redis_store(redis_prefix), api_keys=("k",))
    again = cluster.client(restarted, "k").session(session.id)
    assert again.info.turns == 1 and again.info.status == "idle"
    again.send("and the blue one ?", **ANSWER).text()
    assert again.status().turns == 2


def test_session_rebuilt_on_another_worker_when_its_worker_goes(cluster, redis_prefix, checkpoint):
    """Policy `full`: the rebuilt cache equals the lost one, so the next answer matches a session that
    never moved."""
    turns = [("what is this ?", [png()]), ("and the blue one ?", []), ("how many ?", [])]
    sampling = SamplingParams(**ANSWER)
    reference = Engine.from_pretrained(checkpoint).open_session(deferral=DeferralConfig("full"))
    expected = [reference.turn(Message(t, images=i), sampling).result().token_ids for t, i in turns]

    first = cluster.worker(redis_store(redis_prefix))
    frontend = cluster.frontend(redis_store(redis_prefix))
    session = cluster.client(frontend).create_session(policy="full")
    got = [session.send(t, images=i, **ANSWER).result().token_ids for t, i in turns[:2]]
    second = cluster.worker(redis_store(redis_prefix))
    cluster.stop(first)                 # deregisters: the session's cache is gone with it

    assert session.status().status == "detached"
    got.append(session.send(*turns[2][:1], **ANSWER).result().token_ids)
    status = session.status()
    assert (status.worker_id, status.turns, status.status) == (second.worker_id, 3, "idle")
    assert got == expected


def test_worker_that_lost_a_session_gets_it_rebuilt(cluster, redis_prefix):
    worker = cluster.worker(redis_store(redis_prefix))
    session = cluster.client(cluster.frontend(redis_store(redis_prefix))).create_session()
    session.send("what is this ?", images=[png()], **ANSWER).text()
    worker.runtime.close(session.id)    # as idle reaping or a restart would
    session.send("and the blue one ?", **ANSWER).text()
    assert session.status().turns == 2 and worker.runtime.sessions[session.id].session.turns == 1
