"""The engine lock: re-entrant like an RLock, and a step loop lets a thread already waiting for the lock
go first, so a new turn's admission never waits for another session's whole recovery."""

from __future__ import annotations

import threading
import time

import pytest

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.engine_lock import EngineLock
from tests.deferral.helpers import image_prompt


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the other thread"
        time.sleep(0.001)


def test_reentrant_and_only_the_holder_releases():
    lock = EngineLock()
    with lock, lock.for_step(), lock:
        pass
    assert lock.acquire(blocking=False)
    failures = []

    def other() -> None:
        try:
            lock.release()
        except RuntimeError as e:
            failures.append(e)
        failures.append(lock.acquire(blocking=False))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert isinstance(failures[0], RuntimeError) and failures[1] is False
    lock.release()
    assert lock.acquire(timeout=1.0)
    lock.release()


def test_a_waiting_thread_goes_before_the_next_step():
    lock = EngineLock()
    order: list[str] = []

    def admit() -> None:
        with lock:
            order.append("admission")

    with lock.for_step():                 # a step in progress
        waiter = threading.Thread(target=admit)
        waiter.start()
        _until(lambda: lock.waiting == 1)
    with lock.for_step():                 # the loop's next step, taken at once by an RLock
        order.append("next step")
    waiter.join()
    assert order == ["admission", "next step"]


def test_a_timed_out_wait_leaves_no_waiter_behind():
    lock = EngineLock()
    result = []
    with lock:
        t = threading.Thread(target=lambda: result.append(lock.acquire(timeout=0.05)))
        t.start()
        t.join()
    assert result == [False] and lock.waiting == 0
    with lock.for_step():                 # would wait forever for a waiter left counted
        pass


def _recovering(folder, seed: int = 1):
    """An engine stepping in the background, and a session whose answer left 179 deferred rows to
    recover one per step (about 0.4 s)."""
    engine = Engine.from_pretrained(folder, recovery_chunk=1)
    engine.start_background()
    a = engine.open_session(deferral=DeferralConfig("post_answer", selector="uniform"))
    end = a.turn(image_prompt(engine, seed=seed, grid=(1, 32, 32)),
                 SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
    assert end.metrics.deferred_pending > 100
    return engine, a


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_a_new_turn_is_admitted_while_another_session_recovers(tiny_checkpoints, family):
    """Session B's new turn is admitted while most of session A's gap recovery is still pending, and both
    finish. (With this tiny model's short steps the old lock's race rarely went against the waiter;
    `test_a_waiting_thread_goes_before_the_next_step` pins the rule itself.)"""
    engine, a = _recovering(tiny_checkpoints[family][1])
    try:
        b = engine.open_session(deferral=DeferralConfig("full"))
        stream = b.turn(image_prompt(engine, seed=2), SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert a.pending_deferred > 50
        assert len(stream.result().token_ids) == 2
        a.complete_recovery()
        assert a.pending_deferred == 0
    finally:
        engine.stop_background()


def test_the_next_turn_reports_the_recovery_it_waited_for(tiny_checkpoints):
    """The session's next turn, sent at once, waits at its barrier for the recovery the background
    stepper is running, and says so (the wait used to happen at the lock and be reported as 0)."""
    engine, a = _recovering(tiny_checkpoints["qwen3_5"][1])
    try:
        end = a.turn(image_prompt(engine, seed=2), SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        assert end.metrics.barrier_wait_s > 0.0
    finally:
        engine.stop_background()
