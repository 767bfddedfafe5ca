"""Disaggregated recovery that scales, with a real Ray on loopback: session-resident context on the
deferred workers (a session's later recoveries ship only what its actor lacks), in-flight shipping, and
their faults: a stale copy is never used, the actor holding a copy dies (the next recovery ships
everything to another one), a result arriving after its session closed or its turn was abandoned is
dropped. Answers under `post_answer` are identical in every mode."""

from __future__ import annotations

import time
import uuid

import pytest
import ray
from prometheus_client import REGISTRY

from raincheck_client import Token
from raincheck_core import Engine
from raincheck_core.deferral.handoff import ResidualResult
from services.common.settings import DeferredSettings, ModelSpec
from services.common.store import MemoryStore
from services.deferred_worker.actor import registered, start_actor
from services.deferred_worker.keeper import Keeper
from services.deferred_worker.wire import pack, unpack
from tests.deferral.helpers import image_prompt, rel_err
from tests.deferral.test_handoff_split import ANSWER as SPLIT_ANSWER
from tests.deferral.test_handoff_split import RAINCHECK, Restored, _until
from tests.multimodal.mm_helpers import png
from tests.services.conftest import MODEL, NUM_PAGES
from tests.services.slow_worker import SlowDeferredWorker

POLICY = dict(policy="post_answer", retention=0.3)
ANSWER = dict(max_new_tokens=8, ignore_eos=True)
TURNS = [("what is this ?", [png(128, 96)]), ("and the blue one ?", []),
         ("and this one ?", [png(96, 128, color="green")]), ("which is larger ?", [png(64, 96, color="blue")])]


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def keeper(checkpoint, ray_session):
    """2 registered deferred workers, loaded, in a namespace of the module's own (the decode workers'
    drivers find them by name)."""
    settings = DeferredSettings(namespace=f"raincheck-test-{uuid.uuid4().hex[:12]}", workers=2, num_cpus=0)
    k = Keeper(settings, ModelSpec(str(checkpoint), MODEL, engine={"num_pages": NUM_PAGES}), check_s=1.0).start()
    ray.get([a.ready.remote() for a in registered(settings, MODEL).values()])
    yield k
    k.stop()


def _serve(cluster, address: str, namespace: str, **deferred):
    """A decode worker (disaggregated recovery with `deferred`) behind a frontend of its own; its reports."""
    store = MemoryStore()
    worker = cluster.worker(store, recovery_modes=("colocated", "disaggregated"),
                            deferred=DeferredSettings(ray_address=address, namespace=namespace, num_cpus=0, **deferred))
    reports = []
    worker.runtime.backends["disaggregated"].on_report = reports.append
    return worker, cluster.client(cluster.frontend(store)), reports


def _dialogue(client, mode: str, turns=TURNS) -> list[list[int]]:
    session = client.create_session(recovery=mode, **POLICY)
    answers = []
    for text, images in turns:     # each recovery runs to its end before the next turn (no barrier race)
        turn = session.send(text, images=images, follow_recovery=True, **ANSWER)
        list(turn)
        answers.append(turn.final.token_ids)
    session.close()
    return answers


def test_every_mode_answers_alike_and_resident_context_ships_only_what_is_new(cluster, keeper, ray_address):
    ns = keeper.settings.namespace
    _, full_client, full = _serve(cluster, ray_address, ns, resident_mib=0)
    _, resident_client, resident = _serve(cluster, ray_address, ns)
    _, in_flight_client, in_flight = _serve(cluster, ray_address, ns, ship="input_done")
    expected = _dialogue(full_client, "colocated")
    assert _dialogue(full_client, "disaggregated") == expected
    assert _dialogue(resident_client, "disaggregated") == expected
    assert _dialogue(in_flight_client, "disaggregated") == expected

    _wait(lambda: len(in_flight) == 3)      # a recovery is reported after the join its turn's stream ends on
    for reports in (full, resident, in_flight):
        assert [r.ticket for r in reports] == [0, 2, 3] and all(r.joined == r.rows for r in reports)
    assert all(r.context_shipped == r.context and not r.resident for r in full)
    for reports in (resident, in_flight):                      # one actor keeps the session's context
        first, *later = reports
        assert not first.resident and first.context_shipped == first.context
        assert all(r.resident and r.misses == 0 and r.actor == first.actor for r in later)
        assert all(r.context_shipped < r.context / 2 for r in later)
        assert all(mine < theirs for mine, theirs in zip([r.bytes_out for r in later],
                                                         [r.bytes_out for r in full[1:]], strict=True))
    actors = registered(keeper.settings, MODEL).values()
    _wait(lambda: sum(ray.get(a.stats.remote())["resident_sessions"] for a in actors) == 0)   # dropped at close


def test_stale_and_lost_copies_are_never_used(cluster, keeper, ray_address):
    worker, client, reports = _serve(cluster, ray_address, keeper.settings.namespace)
    backend = worker.runtime.backends["disaggregated"]
    turns = [TURNS[0], TURNS[2], TURNS[3], TURNS[0]]
    expected = _dialogue(client, "colocated", turns)
    stale, gone = _metric("raincheck:deferred_resident_misses_total", reason="stale"), \
        _metric("raincheck:deferred_resident_misses_total", reason="gone")
    session = client.create_session(recovery="disaggregated", **POLICY)

    def send(t: int) -> list[int]:
        turn = session.send(turns[t][0], images=turns[t][1], follow_recovery=True, **ANSWER)
        list(turn)
        # the backend reports a recovery after the join the client's stream ends on: wait for this turn's
        _wait(lambda: len(reports) > t)
        return turn.final.token_ids

    answers = [send(0)]
    backend._resident[session.id].digest = "0" * 32       # this worker now names another copy than the actor's
    answers.append(send(1))
    assert reports[1].misses == 1 and not reports[1].resident
    assert _metric("raincheck:deferred_resident_misses_total", reason="stale") == stale + 1
    answers.append(send(2))
    assert reports[2].resident and reports[2].actor == reports[1].actor
    ray.kill(ray.get_actor(reports[2].actor, namespace=keeper.settings.namespace), no_restart=True)
    answers.append(send(3))
    # the turn goes to another actor, or to the keeper's replacement under the killed one's name (which
    # of the two depends on how fast the keeper respawns it); either way the lost copy is not used
    assert reports[3].misses == 1 and not reports[3].resident
    assert _metric("raincheck:deferred_resident_misses_total", reason="gone") == gone + 1
    assert answers == expected


def test_an_in_flight_result_for_a_closed_session_or_an_abandoned_turn_is_dropped(cluster, checkpoint, ray_address,
                                                                                  ray_namespace):
    spec = ModelSpec(str(checkpoint), MODEL, engine={"num_pages": NUM_PAGES})
    slow = ray.remote(SlowDeferredWorker).options(name=f"deferred:{MODEL}:0", namespace=ray_namespace, num_cpus=0,
                                                  max_concurrency=2).remote(spec, 3.0)
    ray.get(slow.ready.remote())
    _, client, reports = _serve(cluster, ray_address, ray_namespace, ship="input_done")
    failed = sum(_metric("raincheck:deferred_fallbacks_total", reason=r)
                 for r in ("timeout", "worker_died", "ray_lost", "error"))

    closed = client.create_session(recovery="disaggregated", **POLICY)
    # 2,000-token answers: still streaming when the slow deferred worker has started (the engine writes 400
    # tokens of the tiny model in well under a second, faster than Ray starts a call on a loaded machine)
    stream = iter(closed.send(*TURNS[0][:1], images=TURNS[0][1], max_new_tokens=2000, ignore_eos=True))
    assert isinstance(next(stream), Token)                  # its input is in: the residual is on its way
    _wait(lambda: ray.get(slow.started.remote()) == 1)
    closed.close()

    abandoned = client.create_session(recovery="disaggregated", **POLICY)
    # this one must still stream when the worker's second call has started (2,000 tokens were done first
    # in about one run of three on a 2-core host): as long an answer as the pool holds (512 pages of 16)
    turn = abandoned.send(*TURNS[0][:1], images=TURNS[0][1], max_new_tokens=7000, ignore_eos=True)
    assert isinstance(next(iter(turn)), Token)
    _wait(lambda: ray.get(slow.started.remote()) == 2)
    assert abandoned.status().status == "streaming"
    turn.cancel()                                           # the client leaves: the turn is undone
    _wait(lambda: abandoned.status().status != "streaming")

    time.sleep(3.5)                                         # both results are back, and dropped
    assert reports == [] and ray.get(slow.stats.remote())["calls"] == 2
    assert sum(_metric("raincheck:deferred_fallbacks_total", reason=r)
               for r in ("timeout", "worker_died", "ray_lost", "error")) == failed
    assert abandoned.status().cached_tokens == 0
    answer = abandoned.send("what is this ?", images=TURNS[0][1], follow_recovery=True, **ANSWER)
    list(answer)
    assert abandoned.status().pending_deferred_tokens == 0 and len(answer.final.token_ids) == 8
    ray.kill(slow)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_split_through_ray_restores_what_colocated_restores(tiny_checkpoints, ray_session, family):
    """In flight through a real deferred-worker actor: fused chunks restore D's first 7 rows, the actor's
    result the other 9, joined mid-answer; every deferred row's K/V and the GDN prefix state after D are
    colocated recovery's."""
    folder = tiny_checkpoints[family][1]
    actor = start_actor(DeferredSettings(num_cpus=0, resource=""), ModelSpec(str(folder), family))
    engine = Engine.from_pretrained(folder)
    restored = Restored(engine)
    reference = engine.open_session(deferral=RAINCHECK)
    reference.turn(image_prompt(engine, seed=41), SPLIT_ANSWER).result()
    reference.complete_recovery()

    session = engine.open_session(deferral=RAINCHECK)
    stream = session.turn(image_prompt(engine, seed=41), SPLIT_ANSWER)
    ticket = engine.hold_residual(session)
    _until(engine, lambda: stream.request.decoding)
    request = {"session": session.id, "ticket": ticket, "payload": pack(engine.export_residual(session, ticket)),
               "base": None, "adopt": None, "epoch": "e", "keep": False}
    reply = ray.get(actor.prefill.remote(request), timeout=120)
    result = unpack(ResidualResult, reply["result"], engine.device)
    _until(engine, lambda: session.cache.recovery.cursor >= 7)
    joined = engine.apply_residual(session, ticket, result)
    stream.result()
    ray.kill(actor)
    assert joined.offset == 7 and session.cached_tokens == reference.cached_tokens
    (k_ref, v_ref, s_ref), (k, v, s) = restored.seen
    assert rel_err(k, k_ref) <= 1e-5 and rel_err(v, v_ref) <= 1e-5
    if s_ref is not None:
        assert rel_err(s, s_ref) <= 1e-5
