"""What each rank of the tensor-parallel tests runs (module level, so spawned processes can import it).
Every function takes the rank's group first; `None` runs the same at tensor_parallel_size 1."""

from __future__ import annotations

import torch

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.parallel import RankGroup
from tests.engine.reference import image_tokens, random_visual, video_tokens

GRID = (1, 4, 6)
VIDEO_GRID = (2, 4, 4)
STEPS = 21          # the prefill's token, then 20 decode steps


def prompts(engine: Engine) -> list[Prompt]:
    """A text prompt, an image prompt and a video prompt (two frames with their timestamps)."""
    cfg = engine.model_config
    image = random_visual("image", GRID, cfg.hidden_size, cfg.deepstack_levels, seed=4)
    video = random_visual("video", VIDEO_GRID, cfg.hidden_size, cfg.deepstack_levels, seed=5)
    return [Prompt([5, 6, 7, 8, 9, 10, 11, 3]), Prompt([5, 6, *image_tokens(GRID), 7, 8], [image]),
            Prompt([5, *video_tokens(VIDEO_GRID, [11, 12]), 7], [video])]


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


def deferral_logits(group: RankGroup | None, folder: str, expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    """The logits of one image turn under each deferral setting of the identity tests (tests/deferral), and
    of a second turn after the first one's recovery: `full`, `retention1` (raincheck keeping every visual
    token), `fused` and `serial` (chunks of 7 riding on decode steps, or in passes of their own; on a GDN
    model each chunk's state change is joined into the live state), `hard` (D never seen), `post_answer`
    (D restored after the answer), and `…_turn2`, a second turn after the barrier restored the rest of D;
    `bounded_turn2`, a follow-up admitted by a bounded barrier with all of a post-answer D still pending
    (restored during and after it; `bounded_pending` says how much was), and `bounded_turn3` once it is in.
    No prefix cache: every run prefills in the same steps."""
    from raincheck_core.deferral.policy import DeferralConfig
    from tests.deferral.helpers import image_prompt

    engine = Engine.from_pretrained(folder, tensor_parallel_size=1 if group is None else group.world,
                                    expert_parallel=expert_parallel, num_pages=64, max_gdn_slots=8, prefix_cache=False)
    prompt = image_prompt(engine, seed=4)
    settings = {
        "full": DeferralConfig("full"),
        "retention1": DeferralConfig("raincheck", tpot_slo=None, retention=1.0, guard=0),
        "fused": DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7),
        "serial": DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7, fused=False),
        "hard": DeferralConfig("hard", selector="uniform"),
        "post_answer": DeferralConfig("post_answer", selector="uniform"),
    }
    out = {}
    for name, cfg in settings.items():
        session = engine.open_session(deferral=cfg)
        events = session.turn(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True), return_logits=True).tokens()
        out[name] = torch.stack([e.logits for e in events])
        if name in ("fused", "post_answer"):     # what was not restored during the answer, the barrier restores
            events = session.turn(Prompt([11, 12]), SamplingParams(max_new_tokens=4, ignore_eos=True),
                                  return_logits=True).tokens()
            out[f"{name}_turn2"] = torch.stack([e.logits for e in events])
        session.close()
    session = engine.open_session(deferral=settings["post_answer"])
    session.turn(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)).result()
    bounded = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7, barrier_timeout_s=0)
    stream = session.turn(Prompt([11, 12, 13, 14, 15]), SamplingParams(max_new_tokens=6, ignore_eos=True),
                          deferral=bounded, return_logits=True)
    out["bounded_turn2"] = torch.stack([e.logits for e in stream.tokens()])
    out["bounded_pending"] = torch.tensor(float(stream.end.metrics.previous_pending))
    session.complete_recovery()
    events = session.turn(Prompt([16, 17]), SamplingParams(max_new_tokens=4, ignore_eos=True),
                          return_logits=True).tokens()
    out["bounded_turn3"] = torch.stack([e.logits for e in events])
    session.close()
    return out


def deferral_logits_of(group: RankGroup | None, jobs: list[tuple[str, bool]]) -> list[dict[str, torch.Tensor]]:
    return [deferral_logits(group, folder, ep) for folder, ep in jobs]


def turn_after_peer_died(group: RankGroup, folder: str, report: str) -> None:
    """Rank 1 dies once both ranks loaded; rank 0 then runs a turn and writes what it raised to `report`."""
    import os

    engine = engine_for(group, folder)
    group.broadcast_object("loaded")
    if group.rank == 1:
        os._exit(3)
    session = engine.open_session()
    try:
        session.turn(Prompt([5, 6, 7]), SamplingParams(max_new_tokens=2)).result()
        outcome = "no error"
    except Exception as e:
        outcome = type(e).__name__
    with open(report, "w") as f:
        f.write(outcome)


def prefix_hit(group: RankGroup | None, folder: str) -> list[tuple[int, torch.Tensor]]:
    """The same image prompt (a 20-token system prompt first) in two sessions, with the prefix cache:
    per run, the prompt rows served from the cache and the answer's logits."""
    engine = engine_for(group, folder)
    prompt = prompts(engine)[1]
    prompt = Prompt(list(range(20, 40)) + prompt.token_ids, prompt.visuals)
    out = []
    for _ in range(2):
        session = engine.open_session()
        stream = session.turn(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), return_logits=True)
        logits = torch.stack([e.logits for e in stream.tokens()])
        out.append((stream.end.metrics.cached_prompt_tokens, logits))
        session.close()
    return out


def diverging_turns(group: RankGroup, folder: str) -> list[str]:
    """What two turns raised where the ranks diverge: rank 1 given another prompt of the same length
    (its ids differ), then rank 1's pool handing out other pages (its plan writes other slots)."""
    engine = engine_for(group, folder)
    out = []
    for prompt in ([5, 6, 7 + group.rank], [5, 6, 7]):
        if prompt == [5, 6, 7] and group.rank == 1:
            engine.kv.allocate(1)
        session = engine.open_session()
        try:
            session.turn(Prompt(prompt), SamplingParams(max_new_tokens=2)).result()
            out.append("no error")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
        session.close()
    return out


def demo_dialogue(group: RankGroup | None, folder: str) -> list[tuple[list[int], torch.Tensor]]:
    """The shipped demo model (Qwen3.5, a vocabulary of 435: blocks of 218 and 217 rows) on a rendered
    scene through its vision tower and chat template: per turn (the image question, then a follow-up),
    the greedy answer's token ids and logits."""
    import random

    from raincheck_core import Message
    from raincheck_demo.world import make_dialogue

    engine = engine_for(group, folder)
    dialogue = make_dialogue(random.Random(11))
    session = engine.open_session()
    out = []
    for message in (Message(dialogue.questions[0].text, images=[dialogue.scene.png()]),
                    Message(dialogue.questions[1].text)):
        events = session.turn(message, SamplingParams(max_new_tokens=12), return_logits=True).tokens()
        out.append(([e.token_id for e in events], torch.stack([e.logits for e in events])))
    session.close()
    return out


def objective_turn(group: RankGroup, folder: str) -> tuple[list[int], float, float, torch.Tensor]:
    """A raincheck turn under the default TPOT objective (its decisions read measured step times), rank 1
    given a clock 1000 times faster than rank 0's and jittery: the answer's ids, TTFT, TPOT and logits."""
    import random
    import time

    from raincheck_core.deferral.policy import DeferralConfig
    from tests.deferral.helpers import image_prompt

    engine = engine_for(group, folder)
    jitter = random.Random(group.rank)
    engine.use_clock(time.perf_counter if group.rank == 0 else lambda: 1000 * time.perf_counter() + jitter.random())
    session = engine.open_session(deferral=DeferralConfig("raincheck", selector="uniform", chunk_size=7, guard=2))
    stream = session.turn(image_prompt(engine, seed=6), SamplingParams(max_new_tokens=12, ignore_eos=True),
                          return_logits=True)
    events = stream.tokens()
    m = stream.end.metrics
    session.close()
    return [e.token_id for e in events], m.ttft_s, m.tpot_s, torch.stack([e.logits for e in events])


def handoff_turns(group: RankGroup | None, folder: str, remote: bool) -> dict:
    """Turn 1 (an image turn whose deferred rows are pending after its answer), its recovery either
    finished locally or handed to a second engine (what a deferred worker runs; at TP = 2 both are
    tensor-parallel, each rank shipping its own heads), then turn 2: its ids and logits, and per rank the
    KV heads and GDN value heads the payload carried."""
    from raincheck_core.deferral.policy import DeferralConfig
    from tests.deferral.helpers import image_prompt

    engine = engine_for(group, folder)
    worker = engine_for(group, folder) if remote else None
    cfg = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=2, chunk_size=7)
    session = engine.open_session(deferral=cfg)
    session.turn(image_prompt(engine, seed=31), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    shipped = {}
    if worker is not None:
        ticket = engine.hold_residual(session)
        payload = engine.export_residual(session, ticket)
        shipped = {"kv_heads": payload.context_k.shape[2],
                   "gdn_heads": None if payload.prefix_ssm is None else payload.prefix_ssm.shape[1]}
        engine.apply_residual(session, ticket, worker.prefill_residual(payload))
    else:
        session.complete_recovery()
    events = session.turn(Prompt([11, 12, 13]), SamplingParams(max_new_tokens=6, ignore_eos=True),
                          return_logits=True).tokens()
    session.close()
    return {"ids": [e.token_id for e in events], "logits": torch.stack([e.logits for e in events]), **shipped}
