"""What each rank of the tensor-parallel tests runs (module level, so spawned processes can import it).
Every function takes the rank's group first; `None` runs the same at tensor_parallel_size 1."""

from __future__ import annotations

import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.parallel import RankGroup
from tests.engine.reference import image_tokens, random_visual

GRID = (1, 4, 6)
STEPS = 21          # the prefill's token, then 20 decode steps


def prompts(engine: Engine) -> list[Prompt]:
    cfg = engine.model_config
    visual = random_visual("image", GRID, cfg.hidden_size, cfg.deepstack_levels, seed=4)
    return [Prompt([5, 6, 7, 8, 9, 10, 11, 3]), Prompt([5, 6, *image_tokens(GRID), 7, 8], [visual])]


def engine_for(group: RankGroup | None, folder: str, expert_parallel: bool = False) -> Engine:
    return Engine.from_pretrained(folder, tensor_parallel_size=1 if group is None else group.world,
                                  expert_parallel=expert_parallel, num_pages=64, max_gdn_slots=8)


def answer_logits(group: RankGroup | None, folder: str, expert_parallel: bool = False) -> list[torch.Tensor]:
    """Per prompt, the logits `[STEPS, vocab]` of a greedy answer of STEPS tokens, in a session of its own."""
    engine = engine_for(group, folder, expert_parallel)
    out = []
    for prompt in prompts(engine):
        session = engine.open_session()
        events = session.turn(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True),
                              return_logits=True).tokens()
        session.close()
        out.append(torch.stack([e.logits for e in events]))
    return out


def answer_logits_of(group: RankGroup | None, jobs: list[tuple[str, bool]]) -> list[list[torch.Tensor]]:
    """`answer_logits` for each (folder, expert_parallel) of `jobs`, in one process (one start-up)."""
    return [answer_logits(group, folder, ep) for folder, ep in jobs]
