"""Warm-up and calibration: turns of the engine's own before it reports ready.

The first forward pays for lazily built state (kernel libraries loaded, per-shape buffers, allocator
pools), and the TPOT objective knows no step cost yet: a server that routed its first real turn there would
serve it late and schedule its deferred rows on a prior. `warm_up` runs a text turn (a prefill step and
decode steps) and, with `calibrate`, has the cost model measure what the objective needs: the plain decode
step at each batch size it will meet, the step whose decode rows extend GDN joins (a turn with deferred rows
pending, none fused yet), and a step carrying each chunk bucket at those batch sizes (turns with a
synthetic image whose deferred rows are fused in fixed chunks of that bucket). Every session it opens
is closed again, so the engine is as it was, plus what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .deferral.policy import CHUNK_SIZES, DeferralConfig
from .engine.cost_model import WINDOW
from .engine.engine import Engine
from .inputs import Prompt, VisualInput
from .sampling_params import SamplingParams

PROMPT_TOKENS = 16
ANSWER_TOKENS = 4
BATCH_SIZES = (1, 2, 4)        # decode batch sizes calibrated
IMAGE_SIDE = 12                # merged tokens per side of the synthetic image: 144 visual tokens
RETENTION = 0.3                # ~100 deferred rows: each bucket fuses at least one full chunk
CHUNK_STEPS = 8                # answer tokens of a calibration turn: each of its steps fuses a chunk (guard 0)
CHUNK_ROUNDS = 8               # at most this many rounds of chunk turns to fill the buckets' windows
# plain turns and turns whose steps only extend GDN joins alternate in rounds: a drift of the machine's speed
# between them (a neighbour's load, the clock) moves both estimates alike, and the objective reads their
# ratio (a join-tracking step measured 0.7% to 8.7% over a plain one in three warm-ups run one after the other)
REFERENCE_ROUNDS = 4


@dataclass(frozen=True)
class WarmupReport:
    seconds: float          # on the engine's clock
    steps: int
    chunk_buckets: int      # chunk buckets the cost model has measured


def _text(engine: Engine, n: int) -> list[int]:
    """`n` ordinary token ids: none of the model's visual placeholders or stop tokens."""
    cfg = engine.model_config
    reserved = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                *engine.stop_token_ids()}
    ids = [t for t in range(1, cfg.vocab_size) if t not in reserved][:n]
    return [ids[i % len(ids)] for i in range(n)]


def _image_prompt(engine: Engine) -> Prompt:
    """Text, one synthetic image of IMAGE_SIDE x IMAGE_SIDE merged tokens (given as embeddings), text."""
    cfg = engine.model_config
    n, merge = IMAGE_SIDE * IMAGE_SIDE, cfg.spatial_merge_size
    g = torch.Generator().manual_seed(0)
    visual = VisualInput("image", torch.randn(n, cfg.hidden_size, generator=g),
                         (1, merge * IMAGE_SIDE, merge * IMAGE_SIDE),
                         [torch.randn(n, cfg.hidden_size, generator=g) for _ in range(cfg.deepstack_levels)])
    text = _text(engine, PROMPT_TOKENS)
    return Prompt([*text, cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id, *text],
                  [visual])


def _run(engine: Engine, prompts: list[Prompt | list[int]], params: SamplingParams,
         deferral: DeferralConfig | None = None) -> None:
    """Run one turn per prompt side by side (one consumer drives the steps of all), then close them."""
    sessions = [engine.open_session() for _ in prompts]
    try:
        streams = [s.turn(p, params, deferral=deferral) for s, p in zip(sessions, prompts, strict=True)]
        for stream in streams:
            for _ in stream:
                pass
    finally:
        for s in sessions:
            s.close()


def warm_up(engine: Engine, calibrate: bool = True) -> WarmupReport:
    steps = []
    remove = engine.on_step(steps.append)
    t0 = engine.clock()
    try:
        _run(engine, [_text(engine, PROMPT_TOKENS)], SamplingParams(max_new_tokens=ANSWER_TOKENS, ignore_eos=True))
        if calibrate:
            _calibrate(engine)
    finally:
        remove()
    cost = engine.step_costs
    return WarmupReport(engine.clock() - t0, len(steps), cost.buckets_measured())


def _calibrate(engine: Engine) -> None:
    """Fill the cost model's windows (`cost_model.WINDOW` steps of each kind), so that its estimates are
    medians of full windows, held from the first real turn on, instead of a few first steps."""
    cfg = engine.model_config
    images = cfg.image_token_id is not None and cfg.vision_start_token_id is not None   # else nothing defers
    steps = WINDOW // REFERENCE_ROUNDS + 2      # tokens a turn: its decode steps over the rounds fill a window
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    # decode steps that only extend GDN joins (a guard past the answer): the objective's reference while a
    # turn has rows pending
    held = DeferralConfig("raincheck", selector="uniform", retention=RETENTION, guard=steps + 1, tpot_slo=None)
    for batch in BATCH_SIZES:
        for _ in range(REFERENCE_ROUNDS):
            _run(engine, [_text(engine, PROMPT_TOKENS)] * batch, params)
            if images:
                _run(engine, [_image_prompt(engine)] * batch, params, held)
    if not images:
        return
    cost = engine.step_costs
    for _ in range(CHUNK_ROUNDS):     # a turn fuses a bucket's chunks a few times only: rounds until full
        if cost.buckets_full() == len(CHUNK_SIZES):
            return
        for batch in BATCH_SIZES:
            for bucket in CHUNK_SIZES:
                fixed = DeferralConfig("raincheck", selector="uniform", retention=RETENTION, chunk_size=bucket,
                                       guard=0, tpot_slo=None)
                _run(engine, [_image_prompt(engine)] * batch,
                     SamplingParams(max_new_tokens=CHUNK_STEPS, ignore_eos=True), fixed)
