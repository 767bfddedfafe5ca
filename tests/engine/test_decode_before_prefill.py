"""A step whose decode rows come first and another session's prompt rows after them (a session decodes while
a new turn's prompt arrives: the scheduler puts running turns first) runs as one step, on every GDN op
set, and gives each session what it gets alone. The one-row GDN sequences are then step rows 0, 1, ...
without being the whole step: an op that took them for the whole step read every row as a decode row
(the torch rule failed such steps, which were re-run session by session)."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.engine.plan import Kind

NEW = 5
FIRST, SECOND = [5, 9, 12, 30, 7, 8, 40], [11, 3, 17, 60, 2, 19, 23, 25, 6, 13]


def _logits(stream) -> torch.Tensor:
    return torch.stack([e.logits for e in stream.tokens()])


def _alone(engine: Engine, ids: list[int]) -> torch.Tensor:
    session = engine.open_session()
    out = _logits(session.turn(Prompt(ids), SamplingParams(max_new_tokens=NEW, ignore_eos=True), return_logits=True))
    session.close()
    return out


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_decode_rows_before_prompt_rows_run_as_one_step(tiny_checkpoints, backend):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], backend=backend)
    want = [_alone(engine, FIRST), _alone(engine, SECOND)]
    orders, failed = [], []
    engine.on_plan(lambda plan: orders.append([s.kind for s in plan.segments]))
    engine.on_step(lambda stats: failed.append(stats.failed))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    a, b = engine.open_session(), engine.open_session()
    first = a.turn(Prompt(FIRST), params, return_logits=True)
    while not first.request.decoding:
        engine.step()
    engine.step()
    second = b.turn(Prompt(SECOND), params, return_logits=True)
    got = [_logits(first), _logits(second)]
    assert [Kind.DECODE, Kind.PREFILL] in orders
    assert not any(failed)
    for x, y in zip(want, got, strict=True):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert float((x - y).abs().max()) <= 1e-5
