"""A chat session: its cache lives between turns, and each turn prefills only its new tokens."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidInputError, SessionBusyError, SessionClosedError
from ..inputs import Message, Prompt
from ..sampling import SamplingParams
from .events import TokenEvent, TurnEnd, TurnEvent
from .request import TurnRequest
from .sequence import Sequence
from .turn_input import build_turn_input

if TYPE_CHECKING:
    from .engine import Engine

TurnMessage = Message | Prompt | str | list[int]


class Session:
    def __init__(self, engine: Engine, seq: Sequence, session_id: str | None = None):
        self.id = session_id or uuid.uuid4().hex
        self.engine = engine
        self.seq = seq
        self.turns = 0
        self.closed = False
        self._current: TurnRequest | None = None

    def turn(self, message: TurnMessage, sampling: SamplingParams | None = None, *,
             return_logits: bool = False) -> TurnStream:
        """Start a turn. Validation and page reservation happen now (typed errors raise here);
        iterating the returned stream runs it and yields TokenEvents, then one TurnEnd."""
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")
        params = sampling or SamplingParams()
        engine = self.engine
        with engine.lock:
            if self._current is not None and not self._current.finished:
                raise SessionBusyError(f"session {self.id} is still running its previous turn")
            prompt, chat_level = self._prompt(message)
            ids = self.seq.pending_ids + prompt.token_ids
            turn_input = build_turn_input(engine.model, engine.model_config, ids, prompt.visuals,
                                          self.seq.next_position)
            # Reserve every page the turn can need now, so it never fails halfway for lack of memory.
            self.seq.table.reserve(len(turn_input) + params.max_new_tokens)
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.stop_token_ids())
            decode = engine.formatter.decode if engine.formatter is not None else None
            turn_end = engine.formatter.turn_end_id if chat_level else None
            request = TurnRequest(self.seq, turn_input, params, stops, decode, return_logits, turn_end)
            self.seq.pending_ids = []
            self._current = request
            self.turns += 1
            engine.scheduler.add(request)
        return TurnStream(self, request)

    def _prompt(self, message: TurnMessage) -> tuple[Prompt, bool]:
        """The turn's token-level prompt, and whether it came through the chat template."""
        if isinstance(message, Prompt):
            return message, False
        if isinstance(message, list):
            return Prompt(token_ids=list(message)), False
        formatter = self.engine.formatter
        if formatter is None:
            raise InvalidInputError("this checkpoint has no tokenizer: pass a Prompt or token ids")
        if isinstance(message, str):
            message = Message(text=message)
        if (message.images or message.videos) and self.engine.vision is None:
            raise InvalidInputError("this model has no vision tower: images and videos cannot be used")
        cfg = self.engine.model_config
        prompt = formatter.build_prompt(
            message, first_turn=self.turns == 0, vision=self.engine.vision,
            image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
            vision_start_id=cfg.vision_start_token_id, vision_end_id=cfg.vision_end_token_id,
        )
        return prompt, True

    def cancel(self) -> None:
        """Stop the running turn (if any) after the current step; it ends with finish_reason "cancelled"."""
        with self.engine.lock:
            req = self._current
            if req is not None and not req.finished:
                req.finish("cancelled")
                self.engine.scheduler.remove(req)

    def close(self) -> None:
        """Cancel any running turn and return the session's pages and state slot."""
        if self.closed:
            return
        self.cancel()
        self.closed = True
        self.engine._forget(self)

    @property
    def cached_tokens(self) -> int:
        return self.seq.length


class TurnStream:
    """Iterator over one turn's events; `text()` runs it to the end and returns the answer."""

    def __init__(self, session: Session, request: TurnRequest):
        self.session = session
        self.request = request
        self.end: TurnEnd | None = None

    def __iter__(self) -> Iterator[TurnEvent]:
        return self

    def __next__(self) -> TurnEvent:
        req = self.request
        if self.end is not None:
            raise StopIteration
        self.session.engine.drive(req)
        if req.events:
            event = req.events.popleft()
            if isinstance(event, TurnEnd):
                self.end = event
            return event
        if req.error is not None:
            raise req.error
        raise StopIteration

    def tokens(self) -> list[TokenEvent]:
        return [e for e in self if isinstance(e, TokenEvent)]

    def result(self) -> TurnEnd:
        for _ in self:
            pass
        if self.end is None:
            raise RuntimeError("the turn ended without a result")
        return self.end

    def text(self) -> str:
        return self.result().text
