"""A step's tensors go with the step: nothing it builds (the GDN step, its op, the buffers they write) is
left in a reference cycle that only the garbage collector would free. Such cycles held ~90 MiB of step
buffers per 20 soak sessions until a full collection, which moved the server's RSS with the collector's
timing (bench.soak) and would hold device memory on a GPU."""

from __future__ import annotations

import gc

import pytest
import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from tests.engine.reference import image_tokens, random_visual

FUSED = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=7)


def _chat(engine: Engine, seed: int) -> None:
    """An image turn with fused chunks and a join, then a follow-up after the barrier."""
    mc, grid = engine.model_config, (1, 8, 12)
    visual = random_visual("image", grid, mc.hidden_size, mc.deepstack_levels, seed=seed)
    session = engine.open_session(deferral=FUSED)
    session.turn(Prompt([5, 6, *image_tokens(grid), 7, 8], [visual]),
                 SamplingParams(max_new_tokens=12, ignore_eos=True)).result()
    session.turn([21, 22, 23], SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    session.close()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_steps_leave_no_tensors_to_the_garbage_collector(tiny_checkpoints, family):
    engine = Engine.from_pretrained(tiny_checkpoints[family][1])
    _chat(engine, 0)                 # first-use state (caches of the ops) is not garbage
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for seed in (1, 2):
            _chat(engine, seed)
        gc.collect()
        leaked = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not leaked, f"{len(leaked)} tensors were freed only by the garbage collector"
