"""Steps of decode rows reuse the GDN metadata of an earlier step that read the same pool rows
(engine/gdn_inputs.py `DecodeSteps`): built twice for a steady batch (a slot's two rows in turn), with the
same tokens and logits, bit for bit, as building it afresh every step, also once sessions closed and their
slots went to new sessions; and so do padded steps run over a graph's static buffers (engine/graphs.py, eagerly
on the CPU), whose first step of a skeleton is never handed out again (its tensors are the buffers later
steps are copied into), and steps whose rows are tracked (a pending join takes their factors), whose joins
then give the follow-up turn the same logits."""

from __future__ import annotations

import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine import gdn_inputs, runner
from raincheck_core.engine.padding import bucket_of
from raincheck_core.engine.plan import Kind
from tests.deferral.helpers import image_prompt

NEW = 7


def _rounds(engine: Engine) -> list[torch.Tensor]:
    """Two rounds of three sessions decoding side by side (the second round's sessions take the slots the
    first one's left), each answer's logits."""
    out = []
    for r in range(2):
        sessions = [engine.open_session() for _ in range(3)]
        turns = [s.turn(Prompt([5 + i + r, 9, 12, 30 + i, 7, 8, 40]),
                        SamplingParams(max_new_tokens=NEW, ignore_eos=True), return_logits=True)
                 for i, s in enumerate(sessions)]
        out += [torch.stack([e.logits for e in t.tokens()]) for t in turns]
        for s in sessions:
            s.close()
    return out


def test_decode_steps_reuse_their_gdn_metadata_and_change_nothing(tiny_checkpoints, monkeypatch):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    built, decode_steps = [], []
    build = gdn_inputs.gdn_step
    monkeypatch.setattr(gdn_inputs, "gdn_step", lambda *a, **k: built.append(1) or build(*a, **k))
    engine.on_plan(lambda plan: decode_steps.append(all(s.kind is Kind.DECODE for s in plan.segments)))
    kept = _rounds(engine)
    # each round: NEW - 1 steps of three decode rows, whose metadata is built for the first two only
    assert sum(decode_steps) == 2 * (NEW - 1) and len(built) <= 4

    fresh = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    monkeypatch.setattr(fresh.core.runner.decode_steps, "step", lambda placed, *args, **_: build(placed, *args))
    for a, b in zip(kept, _rounds(fresh), strict=True):
        assert torch.equal(a, b)


def _graph_engine(folder) -> Engine:
    engine = Engine.from_pretrained(folder, backend="flex")
    engine.core.runner.use_graphs(capture=False)
    return engine


def test_padded_decode_steps_reuse_their_gdn_metadata_and_change_nothing(tiny_checkpoints, monkeypatch):
    engine = _graph_engine(tiny_checkpoints["qwen3_5"][1])
    built, padded_steps = [], []
    build = gdn_inputs.gdn_step
    monkeypatch.setattr(gdn_inputs, "gdn_step", lambda *a, **k: built.append(1) or build(*a, **k))
    engine.on_plan(lambda plan: padded_steps.append(bucket_of(plan) is not None))
    graphs = engine.core.runner.graphs
    kept = _rounds(engine)
    # three decode rows padded to four: all 2 * (NEW - 1) decode steps replayed over one skeleton's buffers
    assert sum(padded_steps) == 2 * (NEW - 1) and graphs.replays == 2 * (NEW - 1)
    # the two row sets of the slots (the second round takes the first one's slots), and once more the set
    # whose step became the static buffers: built 5 times where every step built it (12)
    assert len(built) <= 6

    fresh = _graph_engine(tiny_checkpoints["qwen3_5"][1])
    monkeypatch.setattr(fresh.core.runner.decode_steps, "step", lambda placed, *args, **_: build(placed, *args))
    for a, b in zip(kept, _rounds(fresh), strict=True):
        assert torch.equal(a, b)


def _tracked_turns(engine: Engine) -> list[torch.Tensor]:
    """Two sessions answer an image turn whose deferred rows wait for the answer's end (every decode row
    tracked by the pending join), then a text follow-up past the join; each answer's logits."""
    answer = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sessions = [engine.open_session(deferral=DeferralConfig("post_answer", selector="uniform")) for _ in range(2)]
    turns = [s.turn(image_prompt(engine, seed=i), answer, return_logits=True) for i, s in enumerate(sessions)]
    out = [torch.stack([e.logits for e in t.tokens()]) for t in turns]
    follow = [s.turn(Prompt([20 + i, 21, 22]), answer, return_logits=True) for i, s in enumerate(sessions)]
    return out + [torch.stack([e.logits for e in t.tokens()]) for t in follow]


def test_tracked_decode_steps_reuse_their_gdn_metadata_and_change_nothing(tiny_checkpoints, monkeypatch):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    tracked, built = [], []     # per step: decode rows alone, some tracked; per build: in such a step

    def plan(p) -> None:
        tracked.append(all(s.kind is Kind.DECODE for s in p.segments) and any(s.tracked for s in p.segments))

    build = gdn_inputs.gdn_step
    for module in (gdn_inputs, runner):
        monkeypatch.setattr(module, "gdn_step", lambda *a, **k: built.append(tracked[-1]) or build(*a, **k))
    engine.on_plan(plan)
    kept = _tracked_turns(engine)
    # NEW - 1 steps of two tracked decode rows, whose metadata is built for the first two only
    assert sum(tracked) == NEW - 1 and sum(built) == 2

    fresh = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1])
    monkeypatch.setattr(fresh.core.runner.decode_steps, "step", lambda placed, *args, **_: build(placed, *args))
    for a, b in zip(kept, _tracked_turns(fresh), strict=True):
        assert torch.equal(a, b)
