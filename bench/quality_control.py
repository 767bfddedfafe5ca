"""The negative control of the quality benchmark: deferred visual tokens *without* their original positions.

Same selection as the engine's `hard`/`raincheck` arms (the engine's own `partition_turn` on the engine's
turn input), but every turn that brings visuals is laid out as `I0 ‖ D ‖ answer` with D prefilled before
the answer's second token (the first comes from I0 alone, as in `raincheck`; the rest see all of D, more
than `raincheck` gives them) and D given fresh sequential 1-D positions, as if appended as text; every
later token continues after them. The `kept` arm is the same layout with D's original positions kept:
the two differ only in D's position ids. Decoding is greedy through `Engine.forward_logits` (a full
prefill per generated token, no session), so no engine hook is needed.
"""

from __future__ import annotations

import torch

from raincheck_core import DeferralConfig, Engine, Message, VisualInput
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.multimodal.turn_input import TurnInput, build_turn_input
from raincheck_demo.world import Dialogue


class Transcript:
    """Rows fed so far (embeddings + [3, T] positions) and the position the next row gets."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.embeds: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.next = 0
        self.rows = 0

    def add_rows(self, embeds: torch.Tensor, positions: torch.Tensor) -> None:
        self.embeds.append(embeds)
        self.positions.append(positions)
        self.next = int(positions.max()) + 1
        self.rows += len(embeds)

    def add_ids(self, ids: list[int]) -> None:
        embed = self.engine.model.embed_tokens
        with torch.no_grad():
            rows = embed(torch.tensor(ids, device=embed.weight.device))
        self.add_rows(rows, torch.arange(self.next, self.next + len(ids)).expand(3, -1))

    def next_token(self, row: int = -1) -> int:
        logits = self.engine.forward_logits(inputs_embeds=torch.cat(self.embeds),
                                            position_ids=torch.cat(self.positions, dim=1))
        return int(logits[row].argmax())


def turn_input(engine: Engine, message: Message, first_turn: bool, cfg: DeferralConfig, start: int = 0
               ) -> tuple[TurnInput, list[VisualInput]]:
    """The engine's input rows for one turn (what a session would prefill), and its visuals."""
    prompt = engine.build_prompt(message, first_turn=first_turn, selection_signals=cfg.needs_vision_signals)
    return build_turn_input(engine.model, engine.model_config, prompt.token_ids, prompt.visuals, start), prompt.visuals


def visual_turn(engine: Engine, transcript: Transcript, message: Message, first_turn: bool, cfg: DeferralConfig,
                fresh_positions: bool) -> int:
    """Feed a turn that brings visuals as `I0 ‖ D`; returns the row of I0's last token, whose logits give
    the first answer token (as in `raincheck`, where the first token is sampled before any of D is prefilled)."""
    full, visuals = turn_input(engine, message, first_turn, cfg, transcript.next)
    parts = partition_turn(full, visuals, cfg, engine.model_config.spatial_merge_size)
    keep, deferred = parts.keep_rows, parts.deferred_rows
    row = transcript.rows + len(keep) - 1
    transcript.add_rows(full.embeds[keep], full.positions[:, keep])
    if not len(deferred):
        return row
    if fresh_positions:
        fresh = torch.arange(full.next_position, full.next_position + len(deferred)).expand(3, -1)
        transcript.add_rows(full.embeds[deferred], fresh)
    else:
        transcript.add_rows(full.embeds[deferred], full.positions[:, deferred])
        transcript.next = full.next_position
    return row


def run_dialogue(engine: Engine, dialogue: Dialogue, messages: list[Message], cfg: DeferralConfig,
                 fresh_positions: bool, max_new: list[int]) -> list[str]:
    """The model's answers to every turn under the control layout."""
    fmt = engine.formatter
    stops = engine.stop_token_ids()
    transcript = Transcript(engine)
    answers: list[str] = []
    for t, message in enumerate(messages):
        row = -1
        if message.images or message.videos:
            row = visual_turn(engine, transcript, message, t == 0, cfg, fresh_positions)
        else:
            transcript.add_ids(fmt.encode(fmt.render_turn(message, first_turn=t == 0)))
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
