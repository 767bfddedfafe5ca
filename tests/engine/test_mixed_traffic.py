"""Scripted mixed traffic, the same on every op set: sessions that start turns while others decode, prefill
or restore (text with shared prefixes, images under raincheck with fused chunks and post-answer recovery,
`full` and `post_answer` turns, follow-ups at the completion barrier or past it), each session's turns
in the same order however the steps interleave them. The GPU path's CPU twins (torch ops; FlexAttention
with the graph path's padded steps, run eagerly) give every turn the native answer, no step fails, and
the steps hold the mixes that matter (decode rows before prompt rows, fused chunks, recovery beside
decoding, prefix hits)."""

from __future__ import annotations

import random

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from tests.deferral.helpers import image_prompt

SHARED = [[20 + j for j in range(37)], [40 + j % 7 for j in range(50)]]     # prompts sessions repeat
GRIDS = [(1, 8, 8), (1, 12, 16)]


def _script(engine: Engine, seed: int) -> list[list[tuple]]:
    """Per session: (earliest step, prompt, sampling, deferral) of each turn, in order. The first turns are
    fixed (sessions 0 and 2 open with one prompt, 2 once 0's is in the prefix cache; 1 fuses chunks from its
    second token; 3 restores after its answer); the follow-ups are drawn."""
    rng = random.Random(seed)
    first = ["text", "raincheck", "text", "post_answer"]
    sessions = []
    for i in range(4):
        turns, at = [], 10 * (i == 2)
        for t in range(3):
            at += rng.randint(0, 12) if t else 0
            kind = first[i] if t == 0 else rng.choice(["text", "raincheck", "raincheck", "full", "post_answer"])
            params = SamplingParams(max_new_tokens=7 if t == 0 else rng.randint(2, 7), ignore_eos=True)
            if kind == "text":
                prompt, cfg = Prompt(SHARED[0] if t == 0 else rng.choice(SHARED)), DeferralConfig("full")
            else:
                prompt = image_prompt(engine, seed=rng.randint(0, 1), grid=rng.choice(GRIDS))
                cfg = DeferralConfig(kind, selector=rng.choice(["uniform", "divprune"]),
                                     guard=1 if t == 0 else rng.choice([1, 4]), chunk_size=rng.choice([7, 15]),
                                     tpot_slo=None, barrier_timeout_s=rng.choice([None, 0.0]))
            turns.append((at, prompt, params, cfg))
        sessions.append(turns)
    return sessions


def _run(engine: Engine, seed: int) -> tuple[dict, list[set[Kind]], list[tuple[Kind, ...]], int]:
    """Each turn's (tokens, logits) by (session, turn); the kinds of every step; the order of kinds in each
    step; the steps that failed."""
    kinds, orders, failed = [], [], []
    remove = [engine.on_plan(lambda plan: (kinds.append({s.kind for s in plan.segments}),
                                          orders.append(tuple(s.kind for s in plan.segments)))),
              engine.on_step(lambda stats: failed.append(stats.failed))]
    script = _script(engine, seed)
    sessions = [engine.open_session() for _ in script]
    started, current, streams, step = [0] * len(script), [None] * len(script), {}, 0
    while True:
        for i, turns in enumerate(script):
            ready = current[i] is None or current[i].request.finished
            if started[i] < len(turns) and ready and turns[started[i]][0] <= step:
                _, prompt, params, cfg = turns[started[i]]
                current[i] = streams[i, started[i]] = sessions[i].turn(prompt, params, deferral=cfg,
                                                                      return_logits=True)
                started[i] += 1
        if started == [len(t) for t in script] and all(c.request.finished for c in current) \
                and not engine.core.has_work():
            break
        engine.step()
        step += 1
    out = {}
    for key, stream in streams.items():
        events = stream.tokens()
        assert stream.request.error is None, (key, stream.request.error)
        out[key] = ([e.token_id for e in events], torch.stack([e.logits for e in events]),
                    stream.result().metrics.cached_prompt_tokens)
    for s in sessions:
        s.close()
    for r in remove:
        r()
    return out, kinds, orders, sum(failed)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def native(tiny_checkpoints, family):
    return _run(Engine.from_pretrained(tiny_checkpoints[family][1]), seed=3)


def test_the_traffic_holds_the_mixes_that_matter(native):
    answers, kinds, orders, failed = native
    assert failed == 0
    assert any(o[:2] == (Kind.DECODE, Kind.PREFILL) for o in orders)      # decode rows before prompt rows
    assert any({Kind.DECODE, Kind.DEFERRED} <= k for k in kinds)          # fused chunks
    assert any({Kind.DECODE, Kind.RECOVERY} <= k for k in kinds)          # recovery beside decoding
    assert any(cached for _, _, cached in answers.values())              # prefix hits


@pytest.mark.parametrize("backend", ["torch", "flex+graphs"])
def test_every_op_set_gives_the_native_answers(tiny_checkpoints, family, native, backend):
    engine = Engine.from_pretrained(tiny_checkpoints[family][1], backend=backend.removesuffix("+graphs"))
    if backend.endswith("+graphs"):
        engine.core.runner.use_graphs(capture=False)
    got, _, _, failed = _run(engine, seed=3)
    assert failed == 0
    want = native[0]
    assert got.keys() == want.keys()
    for key, (tokens, logits, _) in want.items():
        assert got[key][0] == tokens, key
        assert float((got[key][1] - logits).abs().max()) <= 1e-5, key
    if backend.endswith("+graphs"):
        assert engine.core.runner.graphs.replays > 0
