"""GDN state traffic per step (ops/gdn_traffic.py): a decode step moves each sequence's state once in and
once out (its kernel reads the slot's current row and writes the other, the update flips), copies no
state out of the pool and allocates none; the construction agrees with a measurement at the dispatcher,
also on the torch path, which does copy."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.engine.hooks import StepStats
from raincheck_core.ops import native
from raincheck_core.ops.gdn_traffic import StateCopies

SESSIONS = 3


def _decode_steps(engine: Engine) -> list[tuple[StepStats, StateCopies]]:
    """SESSIONS turns started at once, stepped until all of them decode; then 4 decode steps, measured."""
    for i in range(SESSIONS):
        engine.open_session().turn(Prompt([5 + i, 6, 7, 8, 9]), SamplingParams(max_new_tokens=12, ignore_eos=True))
    stats: list[StepStats] = []
    remove = engine.on_step(stats.append)
    while not stats or stats[-1].decode_rows < SESSIONS or stats[-1].prefill_rows:
        engine.step()
    out = []
    for _ in range(4):
        with StateCopies(engine.gdn) as copies:
            engine.step()
        out.append((stats[-1], copies))
    remove()
    return out


@pytest.mark.skipif(not native.gated_deltanet_available("cpu", torch.float32), reason="no C compiler here")
def test_a_native_decode_step_moves_each_state_once_and_copies_none(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], backend="native")
    slot = engine.gdn.slot_bytes
    for stats, copies in _decode_steps(engine):
        traffic = stats.gdn_traffic
        assert stats.decode_rows == SESSIONS and traffic.required == 2 * SESSIONS * slot
        assert traffic.ratio <= 1.1 and traffic.copied == 0
        assert copies.copied == 0 and copies.allocated == 0      # nothing copied out of the pool, no state made


def test_the_torch_paths_copies_are_what_the_construction_counts(tiny_checkpoints):
    """The torch path gathers each state out of the pool and places the new one back: 3x, and the copies
    the dispatcher sees are the ones the construction counts."""
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], backend="torch")
    for stats, copies in _decode_steps(engine):
        traffic = stats.gdn_traffic
        assert traffic.ratio == pytest.approx(3.0) and copies.copied == traffic.copied > 0
