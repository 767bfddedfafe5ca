"""Rebuilding a session on another worker: its history is re-prefilled, with the next turn, as one prompt.

The turn log holds each earlier turn's message and answer ids. The chat-level prompts are rendered as
the engine's own chat turns would be, and each answer is followed by what the engine keeps for the next
turn (`raincheck_core.engine.answer_tail`): the last sampled token and, unless it already is one, the
template's turn-end token (for a stop, the turn-end token replaces the model's other stop token). A turn
logged with its answer's text only (history an HTTP client sent) is tokenized as the template renders it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raincheck_core import Engine, InvalidInputError, Message, Prompt
from raincheck_core.engine import answer_tail

from .._gen import worker_pb2
from .convert import to_message

if TYPE_CHECKING:
    from raincheck_core.multimodal.chat import ChatFormatter


def _answer(turn: worker_pb2.HistoryTurn, formatter: ChatFormatter) -> list[int]:
    """The answer as the cache holds it: the fed tokens (all but the last sampled), then its tail."""
    ids = list(turn.answer_token_ids)
    if not ids and turn.answer_text:   # an answer given as text: as the template renders an assistant message
        formatter.check_text(turn.answer_text)     # no control tokens smuggled in as an "answer"
        return [*formatter.encode(turn.answer_text), formatter.turn_end_id]
    return ids[:-1] + answer_tail(ids, turn.finish_reason, formatter.turn_end_id)


def replay_prompt(engine: Engine, history: list[worker_pb2.HistoryTurn], message: Message) -> Prompt:
    """One token-level prompt: every turn of `history` (message + answer), then `message`."""
    formatter = engine.formatter
    if formatter is None:
        raise InvalidInputError("this checkpoint has no tokenizer: a session cannot be rebuilt from its log")
    ids: list[int] = []
    visuals = []
    messages = [to_message(turn.message) for turn in history] + [message]
    for i, msg in enumerate(messages):
        prompt = engine.build_prompt(msg, first_turn=i == 0)
        ids += prompt.token_ids
        visuals += prompt.visuals
        if i < len(history):
            ids += _answer(history[i], formatter)
    return Prompt(ids, visuals)
