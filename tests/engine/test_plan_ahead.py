"""Decode steps staged while the previous step's forward runs (engine/ahead.py, `EngineConfig.plan_ahead`)
answer exactly as steps planned one after another: the same tokens and logits, bit for bit, on both families,
eager and on the graph path, with turns ending by stop token and by length (their rows in the staged step void),
`n = 2` answers, a turn admitted and one cancelled between two steps, and a forward that fails on a staged step;
no claim or page outlives its step."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from raincheck_core.errors import StepFailedError
from tests.deferral.helpers import GRID, image_prompt


def _engine(folder: Path, ahead: bool, graphs: bool = False, **config: object) -> Engine:
    engine = Engine.from_pretrained(folder, backend="flex", plan_ahead=ahead, **config)
    if graphs:
        engine.use_step_graphs(False)
    return engine


def _prompt(i: int) -> Prompt:
    return Prompt([5 + i, 9, 12, 30 + i, 7, 8, 40 + i])


def _params(i: int, stop: int | None) -> SamplingParams:
    if i == 1:      # sampled: its draws follow its own generator, step by step
        return SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    if i == 2 and stop is not None:
        return SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))
    return SamplingParams(max_new_tokens=(9, 10, 12, 4)[i], ignore_eos=True)


def _script(engine: Engine, stop: int | None) -> list[tuple[list[int], torch.Tensor | None, str]]:
    """Four sessions decoding side by side, stepped by hand: one turn ends by a stop token, one by length;
    after the 3rd step a fifth session's turn is admitted, after the 6th the fourth session's turn is
    cancelled; then a second turn on each. Every answer's tokens, logits and finish reason."""
    sessions = [engine.open_session() for _ in range(5)]
    streams = [s.turn(_prompt(i), _params(i, stop), return_logits=True) for i, s in enumerate(sessions[:4])]
    steps = 0
    while engine.step():
        steps += 1
        if steps == 3:
            streams.append(sessions[4].turn(_prompt(9), SamplingParams(max_new_tokens=6, ignore_eos=True),
                                            return_logits=True))
        if steps == 6:
            sessions[0].cancel()
    streams += [s.turn(Prompt([3, 4, 5 + i]), SamplingParams(max_new_tokens=6, ignore_eos=True), return_logits=True)
                for i, s in enumerate(sessions)]
    out = []
    for stream in streams:
        tokens = stream.tokens()
        out.append(([e.token_id for e in tokens], torch.stack([e.logits for e in tokens]) if tokens else None,
                    stream.result().finish_reason))
    for s in sessions:
        s.close()
    return out


def _assert_same(got: list, want: list) -> None:
    for (tokens, logits, reason), (want_tokens, want_logits, want_reason) in zip(got, want, strict=True):
        assert (tokens, reason) == (want_tokens, want_reason)
        assert (logits is None) == (want_logits is None)
        if logits is not None:
            assert torch.equal(logits, want_logits)


def _released(engine: Engine) -> None:
    """Every session closed: the pools as at start-up (the graph path's scratch page and slot aside)."""
    held = 1 if engine.step_graphs is not None else 0
    assert engine.pool_stats().free_pages == engine.pool_stats().total_pages - held
    if engine.gdn is not None:
        assert engine.gdn.free_slots == engine.config.max_gdn_slots - held


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@pytest.mark.parametrize("graphs", [False, True])
def test_steps_staged_ahead_answer_as_steps_planned_in_turn(tiny_checkpoints, family, graphs):
    folder = tiny_checkpoints[family][1]
    # the stop token: the third token session 2's greedy answer draws (so it ends there, mid-batch)
    probe = _engine(folder, False)
    stop = _script(probe, None)[2][0][2]
    want = _script(_engine(folder, False, graphs), stop)
    assert want[2][2] == "stop" and want[0][2] == "cancelled"

    engine = _engine(folder, True, graphs)
    got = _script(engine, stop)
    _assert_same(got, want)
    counts = engine.ahead_counts
    # most decode steps ran as staged; some were dropped (a stop token, an admission, a cancel in between)
    assert counts.launched >= 6 and counts.dropped >= 2
    assert counts.staged == counts.launched + counts.dropped
    assert engine.core.ahead.pending is None or not engine.has_work()
    _released(engine)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_a_turn_that_ends_leaves_its_row_in_the_staged_step_void(tiny_checkpoints, family):
    """Three sessions decode side by side; one ends by length, one by a stop token, one goes on: the steps staged
    beside those ends still run, the ended turns' rows void, and every session's next turn answers as if the
    steps were planned in turn (nothing of a void row is kept: not its K/V slot, not its GDN state)."""
    folder = tiny_checkpoints[family][1]

    def script(engine: Engine, stop: int | None) -> list:
        sessions = [engine.open_session() for _ in range(3)]
        params = [SamplingParams(max_new_tokens=3, ignore_eos=True),
                  SamplingParams(max_new_tokens=12, stop_token_ids=() if stop is None else (stop,)),
                  SamplingParams(max_new_tokens=9, ignore_eos=True)]
        streams = [s.turn(_prompt(i), p, return_logits=True)
                   for i, (s, p) in enumerate(zip(sessions, params, strict=True))]
        while engine.step():
            pass
        streams += [s.turn(Prompt([3, 4, 5 + i]), SamplingParams(max_new_tokens=5, ignore_eos=True),
                           return_logits=True) for i, s in enumerate(sessions)]
        while engine.step():
            pass
        out = [([e.token_id for e in tokens], torch.stack([e.logits for e in tokens]), st.result().finish_reason)
               for st, tokens in ((st, st.tokens()) for st in streams)]
        for s in sessions:
            s.close()
        return out

    # the stop token: the first of session 1's greedy answer from its fourth token on that it did not draw before
    answer = script(_engine(folder, False), None)[1][0]
    at, stop = next((i, t) for i, t in enumerate(answer) if i >= 3 and t not in answer[:i])
    want = script(_engine(folder, False), stop)
    assert [r for _, _, r in want[:3]] == ["length", "stop", "length"] and len(want[1][0]) == at + 1 < 9
    engine = _engine(folder, True)
    got = script(engine, stop)
    _assert_same(got, want)
    counts = engine.ahead_counts
    # session 0's last step and session 1's stop each left a row void in a step that ran as staged; the last
    # turn's end leaves no step of void rows alone
    assert counts.void_rows >= 2 and counts.launched >= 8
    assert engine.core.ahead.pending is None
    _released(engine)


def test_an_n_answer_turn_beside_a_longer_one_answers_as_planned_in_turn(tiny_checkpoints):
    """`n = 2` answers end together beside a longer turn: the other answer releases its session when it ends, so
    its row is never left void (the staged step goes); the session goes on from answer 0 as planned in turn."""
    folder = tiny_checkpoints["qwen3_5"][1]

    def script(engine: Engine) -> list:
        pair, other = engine.open_session(), engine.open_session()
        streams = [pair.turn(_prompt(0), SamplingParams(temperature=1.0, seed=5, max_new_tokens=5, ignore_eos=True,
                                                        n=2), return_logits=True),
                   other.turn(_prompt(1), SamplingParams(max_new_tokens=9, ignore_eos=True), return_logits=True)]
        events = [list(s) for s in streams]
        ends = [e.token_ids for s in streams for e in s.results()]
        nxt = list(pair.turn(Prompt([3, 4, 5]), SamplingParams(max_new_tokens=4, ignore_eos=True), return_logits=True))
        logits = [torch.stack([e.logits for e in ev if hasattr(e, "logits") and e.logits is not None])
                  for ev in (*events, nxt)]
        pair.close()
        other.close()
        return [ends, logits]

    want = script(_engine(folder, False))
    engine = _engine(folder, True)
    got = script(engine)
    assert got[0] == want[0] and len(got[0]) == 3 and got[0][0] != got[0][1]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    # the two answers end in one step; the other answer's end drops the staged step (no row left void)
    assert engine.ahead_counts.launched > 0 and engine.ahead_counts.dropped >= 1
    assert engine.ahead_counts.void_rows == 0
    _released(engine)


def test_a_step_staged_ahead_holds_its_claims_until_launched_or_dropped(tiny_checkpoints):
    engine = _engine(tiny_checkpoints["qwen3_5"][1], True)
    sessions = [engine.open_session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.turn(_prompt(i), SamplingParams(max_new_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    ahead = engine.core.ahead.pending
    assert ahead is not None and [s.session for s in ahead.plan.segments] == [s.id for s in sessions]
    # each decode row's slot is claimed past the cache's filled length: the next claim comes after it
    for seg, s in zip(ahead.plan.segments, sessions, strict=True):
        assert seg.position == s.cache.next_position
        assert int(seg.write_slots[0]) == int(s.cache.table.reserved_slot(s.cache.length))
    # reading a session's status leaves it staged; any other holder of the engine lock may change the sessions:
    # the staged step goes, its claims with it
    assert sessions[0].status().busy and engine.core.ahead.pending is ahead
    with engine.lock:
        pass
    assert engine.core.ahead.pending is None and engine.ahead_counts.dropped == 1
    for s in sessions:
        assert int(s.cache.claim(1)[0]) == int(s.cache.table.reserved_slot(s.cache.length))
        s.cache.cancel_claims()
    while engine.step():
        pass
    assert all(s.turns == 1 and not s.busy for s in sessions)


def test_a_forward_that_fails_on_a_staged_step_fails_only_its_turn(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3_5"][1]

    def run(ahead: bool) -> tuple[list, int]:
        engine = _engine(folder, ahead)
        victim, other = engine.open_session(), engine.open_session()
        seen = [0]

        def forward(plan):
            if victim.id in plan.sessions():
                seen[0] += 1
                if seen[0] > 4:
                    raise RuntimeError("injected forward failure")
        engine.on_plan(forward)
        failing = victim.turn(_prompt(0), SamplingParams(max_new_tokens=9, ignore_eos=True))
        going = other.turn(_prompt(1), SamplingParams(max_new_tokens=9, ignore_eos=True), return_logits=True)
        with pytest.raises(StepFailedError, match="injected forward failure"):
            failing.result()
        tokens = going.tokens()
        out = [e.token_id for e in tokens], torch.stack([e.logits for e in tokens])
        assert victim.cached_tokens == 0 and victim.turns == 0     # undone to before its turn
        launched = engine.ahead_counts.launched
        victim.close()
        other.close()
        _released(engine)
        return out, launched

    (want_tokens, want_logits), _ = run(False)
    (tokens, logits), launched = run(True)
    assert launched >= 3        # the failing forward was a staged step's
    assert tokens == want_tokens and torch.equal(logits, want_logits)


def test_plan_ahead_stages_nothing_where_the_inputs_are_not_staged(tiny_checkpoints):
    # the native CPU kernels build their inputs in place: nothing to stage ahead; and off by default on a CPU
    folder = tiny_checkpoints["qwen3_vl"][1]
    for engine in (Engine.from_pretrained(folder, backend="native", plan_ahead=True),
                   Engine.from_pretrained(folder, backend="flex")):
        sessions = [engine.open_session() for _ in range(2)]
        for i, s in enumerate(sessions):
            s.turn(_prompt(i), SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
        assert engine.ahead_counts.staged == 0
    # turned on (a benchmark compares both on one engine): staged from then on
    engine.stage_ahead(True)
    sessions[0].turn(_prompt(5), SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
    assert engine.ahead_counts.launched > 0


def test_concurrent_consumers_and_the_background_stepper_with_steps_staged_ahead(tiny_checkpoints):
    # each consumer drives its own turns (`EngineLock.driving`), the background stepper steps the rest, and the
    # consumers' admissions and reads of a turn's end take the lock in between: answers as each session's alone
    folder = tiny_checkpoints["qwen3_5"][1]
    prompts = [[_prompt(i), Prompt([3, 4, 5 + i])] for i in range(4)]
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)

    def dialogue(engine: Engine, i: int, out: dict) -> None:
        session = engine.open_session()
        out[i] = [[e.token_id for e in session.turn(p, params).tokens()] for p in prompts[i]]
        session.close()

    want: dict[int, list] = {}
    alone = _engine(folder, False)
    for i in range(4):
        dialogue(alone, i, want)

    engine = _engine(folder, True)
    engine.start_background()
    got: dict[int, list] = {}
    threads = [threading.Thread(target=dialogue, args=(engine, i, got)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        engine.stop_background()
    assert got == want
    assert engine.ahead_counts.launched > 0
    _released(engine)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@pytest.mark.parametrize("graphs", [False, True])
def test_fused_decode_steps_staged_ahead_answer_as_planned_in_turn(tiny_checkpoints, family, graphs, caplog):
    # raincheck with fixed chunks: the deferred rows ride on the decode steps from the guard on (their chunks
    # planned from the recovery's cursor after the step before, the hybrid's GDN joins extended by every decode
    # row), a short answer's go on beside the others' decode rows, the follow-up reads them all
    rc = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    folder = tiny_checkpoints[family][1]

    def run(ahead: bool) -> tuple[list, Engine, list[int]]:
        engine = _engine(folder, ahead, graphs, recovery_chunk=5)
        # steps with fused chunks, with post-answer chunks beside decode rows, and of those the ones staged ahead
        # (`StepsAhead.take` counts a launch before the plan's hooks run); steps staged during a step that completed an
        # answering session's recovery, or a post-answer one
        fused, launched, completed = [0, 0, 0, 0, 0], [0], [False, False]

        def count(plan) -> None:
            beside = plan.count(Kind.RECOVERY) > 0 and plan.count(Kind.DECODE) > 0
            staged = engine.ahead_counts.launched > launched[0]
            fused[0] += plan.count(Kind.DEFERRED) > 0
            fused[1] += beside
            fused[2] += beside and staged
            fused[3] += completed[0] and staged
            fused[4] += completed[1] and staged
            launched[0], completed[:] = engine.ahead_counts.launched, [False, False]

        def done(cache, _) -> None:
            answering = {s.id for s, stream in zip(sessions, streams, strict=True) if not stream.request.finished}
            completed[0 if cache.session in answering else 1] = True
        engine.on_plan(count)
        engine.on_recovery_done(done)
        sessions = [engine.open_session(deferral=rc) for _ in range(3)]
        # the third answer is short and its image larger: its deferred rows go on after it, as post-answer chunks
        # beside the others' decode rows, after the others' recoveries completed during their answers
        streams = [s.turn(image_prompt(engine, seed=40 + i, grid=(1, 16, 12) if i == 2 else GRID),
                          SamplingParams(max_new_tokens=(12, 12, 4)[i], ignore_eos=True), return_logits=True)
                   for i, s in enumerate(sessions)]
        first = [(streams[i].tokens(), streams[i].result()) for i in range(3)]
        follow = [s.turn(Prompt([11, 12, 13 + i]), SamplingParams(max_new_tokens=5, ignore_eos=True),
                         return_logits=True) for i, s in enumerate(sessions)]
        out = [([e.token_id for e in t], torch.stack([e.logits for e in t]), end.finish_reason)
               for t, end in first + [(f.tokens(), f.result()) for f in follow]]
        for s in sessions:
            s.close()
        return out, engine, fused

    want, _, (fused_steps, beside, _, _, _) = run(False)
    with caplog.at_level(logging.WARNING, logger="raincheck_core.engine.core"):
        got, engine, (_, _, beside_staged, after_completion, after_post_answer) = run(True)
    # no step was staged that cannot be (a post-answer step alone, at the barriers before the follow-ups)
    assert not [r for r in caplog.records if "staging" in r.getMessage()]
    assert fused_steps >= 3 and beside >= 2 and beside_staged >= 1 and after_completion >= 1
    # … and during one that completed a post-answer recovery (it had no rows in the staged step)
    assert after_post_answer >= 1
    _assert_same(got, want)
    assert engine.ahead_counts.launched >= fused_steps // 2
    _released(engine)


def test_recovery_in_the_gaps_is_not_staged_ahead(tiny_checkpoints, caplog):
    # post-answer chunks with no turn decoding beside them (the gaps between turns) are planned as they run: no
    # step staged, nothing that fails to stage (a recovery that completes left a chunk of no rows behind)
    rc = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    engine = _engine(tiny_checkpoints["qwen3_5"][1], True, recovery_chunk=5)
    session = engine.open_session(deferral=rc)
    with caplog.at_level(logging.WARNING, logger="raincheck_core.engine.core"):
        session.turn(image_prompt(engine, seed=7, grid=(1, 16, 12)),
                     SamplingParams(max_new_tokens=3, ignore_eos=True)).result()
        assert session.pending_deferred > 5
        staged = engine.ahead_counts.staged
        while engine.step():
            pass
    assert session.pending_deferred == 0 and engine.ahead_counts.staged == staged
    assert not [r for r in caplog.records if "staging" in r.getMessage()]
