"""Batching changes nothing a session can see: 8 sessions whose steps mix prefill, decode, fused
deferred chunks (fused and serial), post-answer recovery and barriers give each session the same
tokens and logits (fp32, <= 1e-5) as running it alone."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine.plan import Kind
from tests.deferral.helpers import image_prompt

RC = dict(selector="uniform")


def _scripts(engine: Engine) -> list[list[tuple[Prompt, DeferralConfig, int]]]:
    img = [image_prompt(engine, seed=40 + i) for i in range(8)]
    text = [Prompt([5 + i, 9, 12, 30 + i, 7, 8, 40, 41, 3]) for i in range(8)]
    return [
        [(text[0], DeferralConfig("full"), 6)],
        [(img[1], DeferralConfig("full"), 5)],
        [(img[2], DeferralConfig("raincheck", tpot_slo=None, guard=0, chunk_size=7, **RC), 6)],
        [(img[3], DeferralConfig("raincheck", tpot_slo=None, guard=2, chunk_size=7, **RC), 4),
         (text[3], DeferralConfig("full"), 3)],
        [(img[4], DeferralConfig("post_answer", **RC), 2), (text[4], DeferralConfig("full"), 4)],
        [(text[5], DeferralConfig("full"), 2), (text[6], DeferralConfig("full"), 5)],
        [(img[6], DeferralConfig("hard", **RC), 5)],
        [(img[7], DeferralConfig("raincheck", tpot_slo=None, guard=1, chunk_size=15, fused=False, **RC), 5)],
    ]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _alone(engine: Engine, script) -> list[torch.Tensor]:
    session = engine.open_session()
    out = []
    for prompt, cfg, n in script:
        events = session.turn(prompt, _params(n), deferral=cfg, return_logits=True).tokens()
        out.append(torch.stack([e.logits for e in events]))
    session.close()
    return out


def _together(engine: Engine, scripts) -> tuple[list[list[torch.Tensor]], list[tuple[set[Kind], int]]]:
    """All scripts at once; also what each step held: its segment kinds and how many sessions."""
    steps: list[tuple[set[Kind], int]] = []
    remove = engine.on_plan(lambda plan: steps.append(({s.kind for s in plan.segments}, len(plan.sessions()))))
    sessions = [engine.open_session() for _ in scripts]
    streams = [[] for _ in scripts]
    next_turn = [0] * len(scripts)

    def start(i: int) -> None:
        prompt, cfg, n = scripts[i][next_turn[i]]
        streams[i].append(sessions[i].turn(prompt, _params(n), deferral=cfg, return_logits=True))
        next_turn[i] += 1

    for i in range(len(scripts)):
        start(i)
    while True:
        for i, script in enumerate(scripts):
            if streams[i][-1].request.finished and next_turn[i] < len(script):
                start(i)           # the barrier of a deferring turn steps with everyone else
        if all(s[-1].request.finished for s in streams) and next_turn == [len(s) for s in scripts]:
            break
        engine.step()
    remove()
    logits = [[torch.stack([e.logits for e in st.tokens()]) for st in turns] for turns in streams]
    for s in sessions:
        s.close()
    return logits, steps


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_eight_sessions_in_one_step_each_equal_alone(tiny_checkpoints, family, engine_backend):
    folder = tiny_checkpoints[family][1]
    # a deferred budget that never binds: each session's chunk schedule is the same alone and together
    engine = Engine.from_pretrained(folder, max_rows_per_step=4096, deferred_budget=4096, backend=engine_backend)
    scripts = _scripts(engine)
    alone = [_alone(engine, script) for script in scripts]
    together, steps = _together(engine, scripts)
    assert any({Kind.PREFILL, Kind.DECODE, Kind.DEFERRED} <= kinds and n >= 6 for kinds, n in steps)
    assert any({Kind.RECOVERY, Kind.DECODE} <= kinds for kinds, _ in steps)    # gap recovery beside decoding
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        for turn, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.shape == y.shape, (i, turn)
            assert torch.equal(x.argmax(-1), y.argmax(-1)), (i, turn)
            assert float((x - y).abs().max()) <= 1e-5, (i, turn)
