"""A chat session: its cache lives between turns, and each turn prefills only its new tokens."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..deferral.partition import partition_turn
from ..deferral.policy import DeferralConfig
from ..errors import InvalidInputError, SessionBusyError, SessionClosedError, TurnAbortedError
from ..grammar import TokenConstraint
from ..inputs import Message, Prompt
from ..multimodal.turn_input import build_turn_input
from ..sampling_params import SamplingParams
from .events import TokenEvent, TurnEnd, TurnEvent
from .fits import check_fits
from .request import Admission, TurnRequest
from .session_cache import Checkpoint, SessionCache

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..models import DecoderLM
    from ..multimodal.chat import ChatFormatter
    from ..multimodal.vision import VisionEncoder
    from .core import EngineCore
    from .engine_lock import EngineLock
    from .stepper import Stepper

TurnMessage = Message | Prompt | str | list[int]


class SessionHost(Protocol):
    """What a session needs of the engine that opened it (the facade, engine/engine.py)."""

    core: EngineCore
    stepper: Stepper
    lock: EngineLock
    model: DecoderLM
    model_config: ModelConfig
    formatter: ChatFormatter | None
    vision: VisionEncoder | None

    def deferral_for(self, cfg: DeferralConfig) -> DeferralConfig: ...

    def build_prompt(self, message: Message, *, first_turn: bool, selection_signals: bool = False) -> Prompt: ...

    def stop_token_ids(self) -> set[int]: ...

    def release_session(self, session: Session) -> None: ...


@dataclass(frozen=True)
class SessionStatus:
    """Where a session stands, read at one instant (under the engine lock)."""

    turns: int                      # turns admitted (a failed turn is undone and not counted)
    cached_tokens: int              # slots the cache holds
    busy: bool                      # a turn's answer is streaming
    closed: bool
    pending_deferred: int           # deferred tokens of the latest turn not yet prefilled
    recovering: bool                # the answer is over and deferred tokens are still to prefill
    handed_off: bool                # … and they are held for a deferred worker (Engine.hold_residual)
    recovery_ticket: int | None     # the turn index naming the current recovery (hand-off verbs)
    last_recovery_s: float | None   # post-answer completion time of the last finished recovery


class Session:
    def __init__(self, engine: SessionHost, cache: SessionCache, deferral: DeferralConfig | None = None):
        self.id = cache.session
        self.engine = engine
        self.cache = cache
        self.deferral = deferral or DeferralConfig()
        self.closed = False
        self._current: TurnRequest | None = None
        self._undo: Checkpoint | None = None     # the cache before the current turn, until its end is read

    @property
    def turns(self) -> int:
        return self.cache.turns

    def turn(self, message: TurnMessage, sampling: SamplingParams | None = None, *,
             deferral: DeferralConfig | None = None, return_logits: bool = False) -> TurnStream:
        """Start a turn. Validation and page reservation happen now (typed errors raise here);
        iterating the returned stream runs it and yields TokenEvents, then one TurnEnd.

        `deferral` overrides the session's policy for this turn. If the previous turn's deferred
        input is still being recovered, this waits for it first (the completion barrier; the wait is
        reported as `barrier_wait_s`), at most `barrier_timeout_s` when the turn's config sets one: then the
        rest is restored during and after this turn (docs/mechanism.md §10).

        With `sampling.n > 1` the stream yields the events of n answers (`choice` 0..n-1) that share the
        prompt's prefill; the session continues answer 0, the others' pages go back as each ends. Such a
        turn defers nothing: its deferred rows are prefilled with the prompt (docs/mechanism.md §12)."""
        params = sampling or SamplingParams()
        engine = self.engine
        _check_token_ids(params, engine.model_config.vocab_size)
        cfg = engine.deferral_for(deferral or self.deferral)
        if params.n > 1 and cfg.defers:
            cfg = dataclasses.replace(cfg, policy="full")
        self._check_idle()
        # Tokenizing and running the vision tower happen outside the engine lock: other sessions keep
        # stepping meanwhile. Only one turn of this session can get past the re-check in `admit`.
        prompt, chat_level = self._prompt(message, cfg)
        constraints = [self.constraint(params, chat_level) for _ in range(params.n)]
        core = engine.core
        if core.mirror is not None and params.seed is None and params.temperature > 0:
            # worker ranks sample each token too, and must draw the same one: the turn's seed is drawn here
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        with engine.lock, core.replicate("turn", self.id, prompt, chat_level, params, cfg, return_logits):
            request = self.admit(prompt, chat_level, params, cfg, constraints, return_logits)
        return TurnStream(self, request)

    def admit(self, prompt: Prompt, chat_level: bool, params: SamplingParams, cfg: DeferralConfig,
              constraints: list[TokenConstraint | None], return_logits: bool = False) -> TurnRequest:
        """Admit a turn of the rendered `prompt` (call under the engine lock): `prepare_turn`, then the
        core admits it. Returns answer 0's request."""
        self._check_idle()
        admission = self.prepare_turn(prompt, chat_level, params, cfg, constraints, return_logits)
        self.engine.core.admit(admission)
        request = self._current = admission.request
        self._undo = request.checkpoint
        self.engine.stepper.wake()
        return request

    def prepare_turn(self, prompt: Prompt, chat_level: bool, params: SamplingParams, cfg: DeferralConfig,
                     constraints: list[TokenConstraint | None], return_logits: bool = False) -> Admission:
        """What admitting a turn of `prompt` takes (call under the engine lock; `chat_level`: it came
        through the chat template, `constraints`: every answer's grammar): its input rows split into I0
        and D, checked to fit, the previous turn's recovery completed first (the barrier), and answer 0's
        request. Every page the turn can need is counted in (D and the other answers' too), so that neither
        an answer nor the recovery can fail halfway for lack of memory."""
        engine, cache = self.engine, self.cache
        ids = cache.pending_ids + prompt.token_ids
        full = build_turn_input(engine.model, engine.model_config, ids, prompt.visuals, cache.next_position,
                                text_prefix=len(cache.pending_ids), marks=engine.marks)
        parts = partition_turn(full, prompt.visuals, cfg, engine.model_config.spatial_merge_size)
        kept, deferred = len(parts.keep_rows), len(parts.deferred_rows) if cfg.defers else 0
        check_fits(cache, kept, deferred, params.max_new_tokens, params.n, page_size=engine.core.kv.page_size,
                   pool_pages=engine.core.kv.num_pages, max_model_len=engine.core.max_model_len)
        # n answers fork the cache after the prompt: a recovery still pending then would need a join per
        # answer, so such a turn waits for it whatever the bound
        waited = self._barrier(cfg.barrier_timeout_s if params.n == 1 else None, kept)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.stop_token_ids())
        request = TurnRequest(
            cache=cache, turn_input=full.subset(parts.keep_rows) if len(parts.deferred_rows) else full,
            params=params, stop_ids=stops, decode=engine.formatter.decode if engine.formatter is not None else None,
            return_logits=return_logits, turn_end_id=engine.formatter.turn_end_id if chat_level else None,
            deferred_tokens=deferred, barrier_wait_s=waited,
            previous_recovery_s=cache.last_recovery_s if cache.turns else None,
            previous_pending=sum(r.pending for r in cache.recoveries()),
            tpot_slo=cfg.objective, clock=engine.core.clock, constraint=constraints[0])
        return Admission(request, full.subset(parts.deferred_rows) if deferred else None, cfg,
                         kept + deferred + params.max_new_tokens, constraints)

    def _check_idle(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")
        if self.busy:
            raise SessionBusyError(f"session {self.id} is still running its previous turn")

    @property
    def busy(self) -> bool:
        """A turn of this session is running (its answer is still streaming)."""
        return self._current is not None and not self._current.finished

    def _barrier(self, timeout_s: float | None = None, input_rows: int = 0) -> float:
        """Complete the previous turn's recovery, or with `timeout_s`, wait at most that long and until a
        follow-up of `input_rows` input rows may be admitted beside it (`SessionCache.may_go_late`); returns
        the time waited."""
        cache = self.cache
        if cache.recovery is None:
            return 0.0
        core = self.engine.core
        clock = core.clock
        t0 = clock()
        done = None
        if timeout_s is not None:
            def done() -> bool:
                return clock() - t0 >= timeout_s and cache.may_go_late(input_rows)
        steps = self.engine.stepper.complete_recovery(cache, done)
        return clock() - t0 if steps else 0.0     # not waiting at all is exactly 0

    def complete_recovery(self) -> float:
        """Prefill whatever deferred input is left now (normally done in idle gaps or at the next
        turn's barrier). Returns the time it took."""
        with self.engine.lock, self.engine.core.replicate("complete_recovery", self.id):
            return self._barrier()

    @property
    def pending_deferred(self) -> int:
        """Deferred tokens not yet prefilled (the latest turn's, and an earlier turn's a bounded barrier
        left pending)."""
        return sum(r.pending for r in self.cache.recoveries())

    def status(self) -> SessionStatus:
        with self.engine.lock.for_reading():    # a step staged ahead stays (engine/ahead.py)
            rec = self.cache.recovery
            live = rec is not None and not rec.done
            return SessionStatus(
                turns=self.turns, cached_tokens=self.cached_tokens, busy=self.busy, closed=self.closed,
                pending_deferred=sum(r.pending for r in self.cache.recoveries()),
                recovering=live and rec.answer_done, handed_off=live and rec.handed_off,
                recovery_ticket=rec.turn if live else None, last_recovery_s=self.cache.last_recovery_s,
            )

    def _prompt(self, message: TurnMessage, cfg: DeferralConfig) -> tuple[Prompt, bool]:
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
        return self.engine.build_prompt(message, first_turn=self.turns == 0,
                                        selection_signals=cfg.needs_vision_signals), True

    def constraint(self, params: SamplingParams, chat_level: bool) -> TokenConstraint | None:
        """The turn's grammar, compiled against the token that ends its answer (outside the engine lock:
        compiling a large schema takes a while)."""
        if params.grammar is None:
            return None
        engine = self.engine
        if chat_level:
            stop = engine.formatter.turn_end_id
        elif engine.model_config.eos_token_ids:
            stop = engine.model_config.eos_token_ids[0]
        else:
            raise InvalidInputError("this model has no stop token to end a grammar's answer")
        return engine.grammars.constraint(params.grammar, stop)

    def cancel(self) -> None:
        """Stop the running turn (if any) after the current step; it ends with finish_reason "cancelled"."""
        with self.engine.lock, self.engine.core.replicate("cancel", self.id, required=False):
            if self._current is not None:
                self.engine.core.cancel_turn(self._current)

    def abort(self) -> None:
        """Undo the current turn unless its end has been read from its stream: stop it if it still runs,
        and put the session back as it was before the turn was admitted (as after a failed turn; its
        recovery, if any, is dropped). For a turn whose reader has gone, so that the session holds only
        turns someone saw to the end."""
        with self.engine.lock, self.engine.core.replicate("abort", self.id, required=False):
            req, undo = self._current, self._undo
            if req is None or undo is None or req.error is not None:
                return
            error = TurnAbortedError(f"the turn of session {self.id} was abandoned")
            if not req.finished:
                self.engine.core.fail_turn(req, error)
            else:     # it ended, but nobody read the end (its events are left for nobody)
                self.engine.core.undo_ended_turn(req, undo, error)
            self._undo = None

    def end_read(self, turn: int) -> None:
        """The end of the session's turn `turn` was handed to its reader: it is part of the session for
        good (call under the engine lock)."""
        if self._current is not None and self._current.turn == turn:
            self._undo = None

    def close(self) -> None:
        """Cancel any running turn and return the session's pages and state slot."""
        if self.closed:
            return
        with self.engine.lock, self.engine.core.replicate("close", self.id, required=False):
            self.cancel()
            self.closed = True
            self.engine.release_session(self)

    @property
    def cached_tokens(self) -> int:
        return self.cache.length


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
        if any(t >= vocab_size for t in ids):
            raise InvalidInputError(f"{name} names token ids outside the vocabulary (size {vocab_size}): "
                                    f"{sorted(t for t in ids if t >= vocab_size)}")


class TurnStream:
    """Iterator over one turn's events (of every answer, with `n > 1`, in the order they come); `text()`
    runs it to the end and returns answer 0's text, `results()` every answer's end."""

    def __init__(self, session: Session, request: TurnRequest):
        self.session = session
        self.request = request
        self.requests = [request, *request.branches]
        self.end: TurnEnd | None = None          # answer 0's
        self.ends: list[TurnEnd | None] = [None] * len(self.requests)

    def __iter__(self) -> Iterator[TurnEvent]:
        return self

    def __next__(self) -> TurnEvent:
        if all(e is not None for e in self.ends):
            raise StopIteration
        self.session.engine.stepper.drive(*self.requests)
        for req in self.requests:
            if req.events:
                return self._hand_out(req, req.events.popleft())
        for req in self.requests:
            if req.error is not None:
                raise req.error
        raise StopIteration

    def _hand_out(self, req: TurnRequest, event: TurnEvent) -> TurnEvent:
        if isinstance(event, TokenEvent):
            return req.text_of(event)
        if isinstance(event, TurnEnd):
            self.ends[req.choice] = event
            if req is self.request:
                self.end = event
                session = self.session
                with session.engine.lock, session.engine.core.replicate("end_read", session.id, req.turn,
                                                                        required=False):
                    session.end_read(req.turn)
        return event

    def tokens(self) -> list[TokenEvent]:
        return [e for e in self if isinstance(e, TokenEvent)]

    def results(self) -> list[TurnEnd]:
        """Every answer's end, by choice."""
        for _ in self:
            pass
        if any(e is None for e in self.ends):
            raise RuntimeError("the turn ended without a result")
        return list(self.ends)

    def result(self) -> TurnEnd:
        return self.results()[0]

    def text(self) -> str:
        return self.result().text
