"""The deferred-worker pool's decisions, with stand-in actors (no Ray): one residual per actor and the
rest queued; a residual for the actor holding its session's context waits for it, is answered with a
miss when that actor is gone or stays busy while another is free; the pool grows its own actors while
residuals wait (one loading at a time, up to --deferred-max-workers) and stops those beyond
--deferred-workers once idle."""

from __future__ import annotations

import pytest

from services.common.settings import DeferredSettings, ModelSpec
from services.deferred_worker import pool as pool_module
from services.deferred_worker.pool import AFFINITY_WAIT_S, DeferredPool, Job, _Actor


class _Method:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return object()


class _Handle:
    def __init__(self):
        self.calls: list = []
        self.ready = self.prefill = self.forget = _Method(self.calls)


@pytest.fixture
def pool(monkeypatch):
    killed, started = [], []
    monkeypatch.setattr(pool_module, "start_actor", lambda *a, **k: started.append(_Handle()) or started[-1])
    monkeypatch.setattr(pool_module.ray, "kill", killed.append)
    settings = DeferredSettings(workers=1, max_workers=3, scale_up_wait_s=0.5, idle_s=10.0)
    replies = []
    p = DeferredPool(settings, ModelSpec(), "m", replies.append)
    p.actors["a"] = _Actor("a", _Handle(), own=True)
    p.replies, p.started, p.killed = replies, started, killed
    return p


def _job(i: int, received: float, actor: str | None = None) -> Job:
    return Job(i, f"s{i}", actor, {"n": i}, received=received)


def test_one_residual_per_actor_and_the_pool_grows_while_residuals_wait(pool):
    pool.submit(_job(1, 100.0))
    pool.submit(_job(2, 100.0))
    pool._dispatch(100.0)
    assert pool.actors["a"].job.id == 1 and [j.id for j in pool.queue] == [2]
    pool._resize(100.2)                                   # not waited long enough
    assert pool.started == []
    pool._resize(100.6)
    pool._resize(100.7)                                   # one loading at a time
    assert len(pool.started) == 1 and len(pool.actors) == 2
    (new,) = [a for a in pool.actors.values() if a.key != "a"]
    new.ready = None                                      # loaded
    pool._dispatch(100.8)
    assert new.job.id == 2 and pool.queue == []


def test_the_pool_stops_idle_actors_beyond_its_floor(pool):
    pool.actors["b"] = _Actor("b", _Handle(), own=True, idle_since=0.0)
    pool.actors["a"].idle_since = 0.0
    pool._resize(5.0)
    assert pool.killed == []                             # idle 5 s < 10 s
    pool._resize(20.0)
    assert len(pool.killed) == 1 and len(pool.actors) == 1        # down to --deferred-workers


def test_registered_actors_are_not_resized(pool):
    pool.actors["deferred:m:0"] = _Actor("deferred:m:0", _Handle(), own=False)
    pool.actors["a"].job = _job(9, 0.0)
    pool.actors["deferred:m:0"].job = _job(8, 0.0)
    pool.submit(_job(1, 0.0))
    pool._resize(100.0)
    assert pool.started == [] and pool.killed == []


def test_a_residual_for_the_actor_holding_its_context(pool):
    pool.actors["b"] = _Actor("b", _Handle(), own=True)
    pool.actors["a"].job = _job(9, 0.0)                   # busy
    pool.submit(_job(1, 100.0, actor="a"))
    pool.submit(_job(2, 100.0, actor="gone-one"))
    pool._dispatch(100.1)
    assert [j.id for j in pool.queue] == [1]              # waits for its actor
    assert pool.replies[-1] == {"op": "reply", "id": 2, "ok": True, "miss": "gone", "wait_s": pytest.approx(0.1)}
    pool._dispatch(100.0 + AFFINITY_WAIT_S + 0.1)        # still busy while "b" is free: elsewhere, in full
    assert pool.queue == [] and pool.replies[-1]["miss"] == "busy"
    pool.actors["a"].job = None
    pool.submit(_job(3, 200.0, actor="a"))
    pool._dispatch(200.0)
    assert pool.actors["a"].job.id == 3
