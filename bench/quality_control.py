"""The negative control of the quality benchmark: deferred visual tokens *without* their original positions.

Same selection as the engine's `hard`/`raincheck` arms (the engine's own `partition_turn` on the engine's
turn input), but the first turn is laid out as `I0 ‖ D ‖ answer` with D prefilled before the answer's
second token (the first comes from I0 alone, as in `raincheck`; the rest see all of D, more than
`raincheck` gives them) and D given fresh sequential 1-D positions, as if appended as text; every later
token continues after them. The `reordered` arm is the same layout with D's original positions
kept: the two differ only in D's position ids. Decoding is greedy through `Engine.forward_logits`
(a full prefill per generated token, no session), so no engine hook is needed.
"""

from __future__ import annotations

import torch

from raincheck_core import DeferralConfig, Engine, Message
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.models.demo.world import Dialogue
from raincheck_core.multimodal.turn_input import build_turn_input


class Transcript:
    """Rows fed so far (embeddings + [3, T] positions) and the position the next row gets."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.embeds: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.next = 0

    def add_rows(self, embeds: torch.Tensor, positions: torch.Tensor) -> None:
        self.embeds.append(embeds)
        self.positions.append(positions)
        self.next = int(positions.max()) + 1

    def add_ids(self, ids: list[int]) -> None:
        embed = self.engine.model.embed_tokens
        with torch.no_grad():
            rows = embed(torch.tensor(ids, device=embed.weight.device))
        self.add_rows(rows, torch.arange(self.next, self.next + len(ids)).expand(3, -1))

    def next_token(self, row: int = -1) -> int:
        logits = self.engine.forward_logits(inputs_embeds=torch.cat(self.embeds),
                                            position_ids=torch.cat(self.positions, dim=1))
        return int(logits[row].argmax())


def first_turn(engine: Engine, transcript: Transcript, message: Message, cfg: DeferralConfig,
               fresh_positions: bool) -> int:
    """Feed the first turn as `I0 ‖ D`; returns the row of I0's last token, whose logits give the first
    answer token (as in `raincheck`, where the first token is sampled before any of D is prefilled)."""
    mc, fmt, vision = engine.model_config, engine.formatter, engine.vision
    vision.collect_selection_signals = cfg.needs_vision_signals
    prompt = fmt.build_prompt(message, first_turn=True, vision=vision, image_token_id=mc.image_token_id,
                              video_token_id=mc.video_token_id, vision_start_id=mc.vision_start_token_id,
                              vision_end_id=mc.vision_end_token_id)
    full = build_turn_input(engine.model, mc, prompt.token_ids, prompt.visuals, 0)
    parts = partition_turn(full, prompt.visuals, cfg, mc.spatial_merge_size)
    keep, deferred = parts.keep_rows, parts.deferred_rows
    transcript.add_rows(full.embeds[keep], full.positions[:, keep])
    if fresh_positions:
        fresh = torch.arange(full.next_position, full.next_position + len(deferred)).expand(3, -1)
        transcript.add_rows(full.embeds[deferred], fresh)
    else:
        transcript.add_rows(full.embeds[deferred], full.positions[:, deferred])
        transcript.next = full.next_position
    return len(keep) - 1


def run_dialogue(engine: Engine, dialogue: Dialogue, png: bytes, cfg: DeferralConfig, fresh_positions: bool,
                 max_new: list[int]) -> list[str]:
    """The model's answers to every turn under the control layout."""
    fmt = engine.formatter
    stops = engine.stop_token_ids()
    transcript = Transcript(engine)
    answers: list[str] = []
    for t, q in enumerate(dialogue.questions):
        row = -1
        if t == 0:
            row = first_turn(engine, transcript, Message(q.text, images=[png]), cfg, fresh_positions)
        else:
            transcript.add_ids(fmt.encode(fmt.render_turn(Message(q.text), first_turn=False)))
        generated: list[int] = []
        while len(generated) < max_new[t]:
            token = transcript.next_token(row if not generated else -1)
            generated.append(token)
            if token in stops:
                break
            transcript.add_ids([token])
        answers.append(fmt.decode(generated))
        # as the engine does: the closing stop token is fed at the start of the next turn
        transcript.add_ids([generated[-1]] if generated[-1] == fmt.turn_end_id else [fmt.turn_end_id])
    return answers
