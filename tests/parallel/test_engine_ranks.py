"""An engine that starts its own ranks: `Engine.from_pretrained(path, tensor_parallel_size=2)` in an
ordinary process (this one is rank 0; the worker rank is a child process replaying its calls)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.errors import InvalidInputError, RankFailedError
from tests import tiny
from tests.deferral.helpers import image_prompt

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def dialogue(engine: Engine) -> dict[str, tuple[list[int], torch.Tensor]]:
    """What the test compares at TP = 1 and 2: per turn, the answer's ids and logits. A raincheck image
    turn whose deferred rows the background stepper recovers after its answer, a follow-up (the barrier),
    a second session's text turn beside it on another thread, sampled with a temperature."""
    out = {}
    engine.start_background()
    first = engine.open_session(deferral=DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2,
                                                        chunk_size=7))
    second = engine.open_session()

    def run(name: str, session, prompt, params: SamplingParams) -> None:
        events = session.turn(prompt, params, return_logits=True).tokens()
        out[name] = ([e.token_id for e in events], torch.stack([e.logits for e in events]))

    run("image", first, image_prompt(engine, seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True))
    beside = threading.Thread(target=run, args=("sampled", second, Prompt([5, 6, 7, 8, 9]),
                                                SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8,
                                                               seed=17)))
    beside.start()
    run("follow_up", first, Prompt([11, 12, 13]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    beside.join()
    first.close()
    second.close()
    return out


@pytest.fixture(scope="module")
def qwen3_5(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["qwen3_5"][1])


def test_an_engine_that_starts_its_ranks_answers_as_tp1_and_leaves_no_process(qwen3_5):
    want = dialogue(Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8, tensor_parallel_size=1))
    with Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8, tensor_parallel_size=2) as engine:
        procs = list(engine.ranks.procs)
        assert engine.model.tp.world == 2 and engine.model.tp.rank == 0
        got = dialogue(engine)
        assert engine.rank_failure is None
    for name, (ids, logits) in want.items():
        assert got[name][0] == ids, name
        assert float((got[name][1] - logits).abs().max()) <= TOL, name
    assert [p.exitcode for p in procs] == [0]       # closed: the worker rank stopped by itself
    assert engine.rank_failure == "the engine is closed"


def test_a_killed_worker_rank_fails_turns_with_a_typed_error_not_a_hang(qwen3_5):
    with Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8, tensor_parallel_size=2) as engine:
        session = engine.open_session()
        end = session.turn(Prompt([5, 6, 7]), SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        assert end.metrics.generated_tokens == 2
        stream = session.turn(Prompt([8, 9]), SamplingParams(max_new_tokens=50, ignore_eos=True))
        next(iter(stream))
        worker = engine.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(RankFailedError):      # the turn in flight
            stream.result()
        assert engine.rank_failure is not None
        with pytest.raises(RankFailedError):      # and every later one, at once
            engine.open_session().turn(Prompt([5, 6]), SamplingParams(max_new_tokens=2))
        session.close()                           # closing still works (local bookkeeping only)


@pytest.mark.parametrize(("end", "wait_s"), [("raise SystemExit(0)", 0.0), ("os._exit(0)", 60.0)])
def test_a_worker_rank_never_outlives_an_engine_left_unclosed(qwen3_5, end, wait_s):
    """Rank 0's process ends without closing its engine: normally (its exit handler stops the worker
    before the process is gone), or without running exit handlers, as when killed (the worker notices
    its parent is gone and exits)."""
    script = textwrap.dedent(f"""
        import os
        from raincheck_core import Engine
        engine = Engine.from_pretrained({qwen3_5!r}, num_pages=32, max_gdn_slots=4, tensor_parallel_size=2)
        print(engine.ranks.procs[0].pid, flush=True)
        {end}
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert _gone(int(out.stdout.split()[-1]), timeout_s=wait_s)


def _gone(pid: int, timeout_s: float) -> bool:
    """The process `pid` exited within `timeout_s` (a zombie, exited but not yet reaped, counts)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)



def _wider_mlp(cfg) -> None:
    cfg.text_config.intermediate_size += 1


@pytest.mark.parametrize(("family", "model", "tp", "change", "match"), [
    ("qwen3_vl", "Qwen3VLForConditionalGeneration", 3, None, r"the attention heads \(\d+\) must"),
    ("qwen3_5", "Qwen3_5ForConditionalGeneration", 2, _wider_mlp, r"the MLP's intermediate size \(\d+\) must"),
])
def test_heads_or_widths_that_do_not_split_fail_before_any_rank_starts(tmp_path, family, model, tp, change, match):
    import multiprocessing

    import transformers

    cfg = tiny.build_config(family)
    if change is not None:
        change(cfg)
    folder = tiny.save_model(getattr(transformers, model)(cfg).eval(), tmp_path)
    with pytest.raises(InvalidInputError, match=match + rf" be divisible by tensor_parallel_size \({tp}\)"):
        Engine.from_pretrained(folder, tensor_parallel_size=tp)
    assert not multiprocessing.active_children()


def handoff(engine: Engine, worker: Engine | None) -> dict:
    """An image turn whose deferred rows are pending after its answer, recovered by `worker` (a hand-off:
    export, prefill there, apply) or locally; then a follow-up: its ids and logits, and the K/V heads the
    payload carried."""
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    session = engine.open_session(deferral=cfg)
    session.turn(image_prompt(engine, seed=31), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    out = {}
    if worker is None:
        session.complete_recovery()
    else:
        ticket = engine.hold_residual(session)
        payload = engine.export_residual(session, ticket)
        out["kv_heads"] = payload.context_k.shape[2]
        engine.apply_residual(session, ticket, worker.prefill_residual(payload))
    events = session.turn(Prompt([11, 12, 13]), SamplingParams(max_new_tokens=6, ignore_eos=True),
                          return_logits=True).tokens()
    session.close()
    return {**out, "ids": [e.token_id for e in events], "logits": torch.stack([e.logits for e in events])}


def test_an_engine_that_started_its_ranks_hands_off_whole_heads(qwen3_5):
    """Its payload and result carry every rank's heads, merged on rank 0, so the other side may run at
    any tensor_parallel_size: a TP = 2 decoder handing off to a TP = 1 worker and the other way round
    give the answers of a recovery finished locally at TP = 1."""
    single = Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8)
    want = handoff(single, None)
    with Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8, tensor_parallel_size=2) as split:
        results = [handoff(split, single), handoff(single, split)]
    for got in results:
        assert got["ids"] == want["ids"]
        assert float((got["logits"] - want["logits"]).abs().max()) <= TOL
        assert got["kv_heads"] == single.model_config.num_kv_heads


def test_a_plan_hook_failing_on_rank_0_fails_the_turn_and_the_engine_serves_on(qwen3_5):
    """Fault injection on rank 0 only (its worker has no hooks): the worker is told before the forward,
    fails the same step, and both ranks go on in step: the next turn answers as at TP = 1."""
    from raincheck_core.errors import StepFailedError

    want = Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8).open_session().turn(
        Prompt([5, 6, 7, 8]), SamplingParams(max_new_tokens=5, ignore_eos=True)).result().token_ids
    with Engine.from_pretrained(qwen3_5, num_pages=64, max_gdn_slots=8, tensor_parallel_size=2) as engine:
        def fail(plan) -> None:
            raise RuntimeError("injected")

        remove = engine.on_plan(fail)
        with pytest.raises(StepFailedError, match="injected"):
            engine.open_session().turn(Prompt([9, 10]), SamplingParams(max_new_tokens=3)).result()
        remove()
        session = engine.open_session()
        end = session.turn(Prompt([5, 6, 7, 8]), SamplingParams(max_new_tokens=5, ignore_eos=True)).result()
        assert end.token_ids == want and engine.rank_failure is None


def test_one_gpu_named_for_several_ranks_is_refused_before_any_rank_starts(qwen3_5):
    import multiprocessing

    with pytest.raises(InvalidInputError, match="give 'cuda'"):
        Engine.from_pretrained(qwen3_5, device="cuda:1", tensor_parallel_size=2)
    assert not multiprocessing.active_children()
