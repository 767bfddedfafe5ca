"""Warm-up: one short turn through the whole step path before an engine reports ready.

The first forward pays for lazily built state (kernel libraries loaded, per-shape buffers, allocator
pools), and the TPOT objective has no plain-step measurement yet; a server that routes its first real
turn there serves it late and schedules it on a prior. `warm_up` runs a text turn of its own (a prefill
step and decode steps) in a scratch session that is closed again, so the engine is as it was, plus what it
measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams
from .engine import Engine

PROMPT_TOKENS = 16
ANSWER_TOKENS = 4


@dataclass(frozen=True)
class WarmupReport:
    seconds: float          # on the engine's clock
    steps: int


def _prompt(engine: Engine, n: int) -> list[int]:
    """`n` ordinary token ids: none of the model's visual placeholders or stop tokens."""
    cfg = engine.model_config
    reserved = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                *engine.stop_token_ids()}
    ids = [t for t in range(1, cfg.vocab_size) if t not in reserved][:n]
    return [ids[i % len(ids)] for i in range(n)]


def warm_up(engine: Engine) -> WarmupReport:
    """Run one turn of `PROMPT_TOKENS` prompt and `ANSWER_TOKENS` answer tokens in a session of its own."""
    steps = []
    remove = engine.on_step(steps.append)
    t0 = engine.clock()
    session = engine.open_session()
    try:
        for _ in session.turn(_prompt(engine, PROMPT_TOKENS),
                              SamplingParams(max_new_tokens=ANSWER_TOKENS, ignore_eos=True)):
            pass
    finally:
        session.close()
        remove()
    return WarmupReport(engine.clock() - t0, len(steps))
