"""One HTTP chat request as one session turn, through the frontend's ChatService.

Matching (docs/services.md, HTTP API): the request's history digest is looked up as a session tip.
- found: the session's own next turn (`continued`): only the new message is prefilled, after the
  previous turn's recovery completes at the barrier;
- not found, with history: a new session (`forked`) whose turn log is the history: copied from the
  session that logged its longest matching prefix (answer token ids included), the rest from the request
  (answers tokenized by the worker). Its first turn re-prefills the history, as a rebuild does; the
  session it diverged from is never touched;
- no history: a new session (`new`).
After the answer, the session's new history becomes its tip. A turn that ends early (a stop string, a
cancel) leaves no tip: what the client saw is not what the session holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from raincheck_client._gen import chat_pb2

from ..common.events import read
from ..common.grpc_util import ServiceError
from ..common.logs import bind
from ..common.recovery_modes import MODES
from ..common.store import QuotaError, SessionRecord, Store, TurnRecord
from ..frontend.servicer import ChatServicer
from .call import HttpCall
from .conversation import Conversation, record_digest
from .index import SessionIndex, Tip
from .metrics import PROMPT_TOKENS, SESSION_MATCHES
from .stops import StopMatcher

log = logging.getLogger(__name__)
# A claimed tip whose session answers these is gone (expired, closed, its history's images expired).
GONE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS)


@dataclass
class TurnSpec:
    model: str
    conversation: Conversation
    sampling: chat_pb2.SamplingOptions
    deferral: chat_pb2.DeferralSettings | None = None   # Raincheck's knobs from the request; None: defaults
    recovery_mode: str | None = None                     # for a new session; None: the frontend's default
    stop: Sequence[str] = ()
    keep_stop: bool = False
    render: chat_pb2.RenderOptions | None = None         # chat template variables, image preprocessing
    grammar_field: str | None = None                     # the request's field that set sampling.grammar


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int                     # the whole conversation's, as the model saw it
    completion_tokens: int
    cached_tokens: int                     # of the prompt tokens, those the session already held or the
                                           # worker's prefix cache served


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[chat_pb2.TokenDelta, ...] = ()   # the tokens since the last delta (with logprobs asked)
    choice: int = 0                        # which answer (n > 1)


@dataclass(frozen=True)
class Done:
    text: str                              # the answer as shown (cut at a stop string)
    finish_reason: str                     # stop | length | cancelled
    matched_stop: str | None
    usage: Usage
    session_id: str
    match: str                             # continued | forked | new
    metrics: chat_pb2.TurnMetrics = field(repr=False)
    logprobs: tuple[chat_pb2.TokenDelta, ...] = ()   # every shown token's (with logprobs asked)
    unsent_logprobs: tuple[chat_pb2.TokenDelta, ...] = ()   # of those, the ones no Delta carried
    choice: int = 0                        # which answer (n > 1); answer 0's Done comes last

    def details(self) -> dict:
        """Raincheck's view of the turn (the `raincheck` field of responses)."""
        m = self.metrics
        return {"session_id": self.session_id, "match": self.match,
                "prefilled_tokens": m.prompt_tokens - m.cached_prompt_tokens,
                "deferred_tokens": m.deferred_tokens, "deferred_pending": m.deferred_pending,
                "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "barrier_wait_s": m.barrier_wait_s,
                "drafts_proposed": m.drafts_proposed, "drafts_accepted": m.drafts_accepted}


class ChatBackend:
    def __init__(self, servicer: ChatServicer, store: Store, index: SessionIndex):
        self.servicer = servicer
        self.store = store
        self.index = index

    def owner(self, call: HttpCall) -> str:
        """The caller's key id ("" without auth); UNAUTHENTICATED otherwise."""
        return self.servicer.auth.identify(call)

    def models(self) -> list[str]:
        return sorted({w.model for w in self.store.workers()})

    def model_times(self) -> dict[str, int]:
        """Each served model, with when its longest-serving worker loaded it (seconds since the epoch)."""
        times: dict[str, float] = {}
        for w in self.store.workers():
            times[w.model] = min(times.get(w.model, w.started_at), w.started_at)
        return {name: int(times[name]) for name in sorted(times)}

    def start(self, call: HttpCall, owner: str, spec: TurnSpec) -> Turn:
        """Match the history and start the turn (errors raise here as ServiceError, before any output)."""
        served = self.models()
        if spec.model not in served:
            raise ServiceError.not_found(f"the model {spec.model!r} does not exist (served: {', '.join(served)})")
        conv = spec.conversation
        conv.bind(owner, spec.model, spec.recovery_mode or "", spec.render)
        if not conv.history:
            return self._new(call, owner, spec)
        tip = self.index.claim(conv.digests[-1])
        if tip is not None:
            turn = self._continue(call, owner, spec, tip)
            if turn is not None:
                return turn
        return self._fork(call, owner, spec)

    # -- the three ways a turn starts -------------------------------------------------------------------
    def _continue(self, call: HttpCall, owner: str, spec: TurnSpec, tip: Tip) -> Turn | None:
        """The tip's session's next turn; None when that session is gone (the caller forks instead)."""
        digest = spec.conversation.digests[-1]
        try:
            info = self.servicer.GetSession(chat_pb2.GetSessionRequest(session_id=tip.session_id), call)
            # a detached session (its worker is gone) is rebuilt by this turn: nothing of it is cached
            cached = 0 if info.status == chat_pb2.SESSION_STATUS_DETACHED else tip.context_tokens
            events = self._chat(call, tip.session_id, spec, spec.deferral)
        except ServiceError as e:
            if e.code in GONE:
                bind(log, session_id=tip.session_id).info("matched session is gone (%s): forking", e.message)
                return None
            self.index.release(digest, tip)
            raise
        return Turn(self, call, owner, spec, tip.session_id, "continued", cached, events)

    def _new(self, call: HttpCall, owner: str, spec: TurnSpec) -> Turn:
        self._make_room(call, owner)
        info = self.servicer.CreateSession(chat_pb2.CreateSessionRequest(
            model=spec.model, deferral=spec.deferral, recovery_mode=self._mode(spec)), call)
        return Turn(self, call, owner, spec, info.session_id, "new", 0, self._first_chat(call, info.session_id, spec))

    def _fork(self, call: HttpCall, owner: str, spec: TurnSpec) -> Turn:
        """A new session holding the history as its turn log (detached: its first turn opens it on a worker
        with the log as history, which re-prefills it in front of the new message)."""
        conv = spec.conversation
        records = self._logged_prefix(conv)
        logged = len(records)
        render = json_format.MessageToDict(spec.render) if spec.render is not None else {}
        records += [TurnRecord(text=t.user.text, images=t.user.image_hashes, videos=[], answer_token_ids=[],
                               answer_text=t.answer, finish_reason="stop", render=render)
                    for t in conv.history[len(records):]]
        self._mode(spec)
        self._make_room(call, owner)
        record = SessionRecord(uuid.uuid4().hex, owner, spec.model, "", json_format.MessageToDict(
            spec.deferral or chat_pb2.DeferralSettings()), spec.recovery_mode or self.servicer.sessions.default_mode)
        try:
            self.store.create_session(record, self._quota(owner))
        except QuotaError as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        for r, turn in zip(records, conv.history, strict=True):   # the rebuild reads the images as blobs
            self.store.append_turn(record.session_id, r, dict(zip(turn.user.image_hashes, turn.user.images,
                                                                  strict=True)))
        bind(log, session_id=record.session_id).info("forked: %d history turns, %d copied from a session's log",
                                                     len(records), logged)
        events = self._first_chat(call, record.session_id, spec)
        return Turn(self, call, owner, spec, record.session_id, "forked", 0, events)

    # -- helpers --------------------------------------------------------------------------------------------
    def _quota(self, owner: str) -> int | None:
        """The key's limit of open sessions (None without API keys)."""
        return self.servicer.settings.max_sessions_per_key if owner else None

    def _make_room(self, call: HttpCall, owner: str) -> None:
        """At the key's session quota, close its least recently used idle session that this API matched:
        stateless clients never close sessions themselves. A later request for that conversation forks."""
        limit = self._quota(owner)
        if limit is None or self.store.open_sessions(owner) < limit:
            return
        victim = self.index.evict(owner)
        if victim is not None:
            bind(log, session_id=victim).info("closing the key's least recently used HTTP session (quota %d)",
                                              limit)
            self._close(call, victim)

    def _mode(self, spec: TurnSpec) -> int:
        if spec.recovery_mode is None:
            return chat_pb2.RECOVERY_MODE_UNSPECIFIED
        if spec.recovery_mode not in MODES:
            raise ServiceError.invalid(f"recovery_mode is one of {', '.join(MODES)}; got {spec.recovery_mode!r}")
        return MODES[spec.recovery_mode]

    def _chat(self, call: HttpCall, session_id: str, spec: TurnSpec,
              deferral: chat_pb2.DeferralSettings | None) -> Iterator[chat_pb2.ChatEvent]:
        request = chat_pb2.ChatRequest(session_id=session_id, message=spec.conversation.message.proto(spec.render),
                                       sampling=spec.sampling, deferral=deferral)
        return self.servicer.Chat(request, call)

    def _first_chat(self, call: HttpCall, session_id: str, spec: TurnSpec) -> Iterator[chat_pb2.ChatEvent]:
        """The first turn of a session opened for this request; the session is closed if it cannot start."""
        try:
            return self._chat(call, session_id, spec, None)
        except ServiceError:
            self._close(call, session_id)
            raise

    def _close(self, call: HttpCall, session_id: str) -> None:
        try:
            self.servicer.CloseSession(chat_pb2.CloseSessionRequest(session_id=session_id), call)
        except ServiceError as e:
            bind(log, session_id=session_id).warning("cannot close the session: %s", e.message)

    def _logged_prefix(self, conv: Conversation) -> list[TurnRecord]:
        """The longest prefix of the history that a session logged, as logged (None found: [])."""
        for j in range(len(conv.history), 0, -1):
            source = self.index.source(conv.digests[j])
            if source is None or source.turns != j:
                continue
            records = self.store.turns(source.session_id)[:j]
            digest = conv.digests[0]
            for k, record in enumerate(records):
                digest = record_digest(digest, record)
                if digest != conv.digests[k + 1]:
                    break
            else:
                if len(records) == j:
                    return records
        return []


@dataclass
class _Answer:
    """One answer of a turn as it streams: its stop strings, the text shown, the tokens with logprobs."""

    stops: StopMatcher
    shown: list[str] = field(default_factory=list)
    scored: list[chat_pb2.TokenDelta] = field(default_factory=list)
    sent: int = 0                          # of `scored`, those a Delta carried

    def delta(self, text: str, choice: int) -> Delta:
        self.shown.append(text)
        out = Delta(text, tuple(self.scored[self.sent:]), choice)
        self.sent = len(self.scored)
        return out


@dataclass(eq=False)
class Turn:
    """A started turn: `run()` yields the answer's text deltas, then `Done` (blocking; call from a thread).
    `close()` ends the call, cancelling the worker's turn if it still runs; call it in every case."""

    backend: ChatBackend
    call: HttpCall
    owner: str
    spec: TurnSpec
    session_id: str
    match: str                             # continued | forked | new
    cached_tokens: int
    events: Iterator[chat_pb2.ChatEvent] = field(repr=False)   # the frontend's Chat stream

    def __post_init__(self) -> None:
        SESSION_MATCHES.labels(self.match).inc()

    def run(self) -> Iterator[Delta | Done]:
        """Each answer's deltas (n > 1: interleaved, by choice) and its Done; answer 0's Done comes last.
        Errors after the start (the worker failed mid-turn) raise ServiceError."""
        n = self.spec.sampling.n if self.spec.sampling.HasField("n") else 1
        answers = [_Answer(StopMatcher(self.spec.stop, keep=self.spec.keep_stop)) for _ in range(max(n, 1))]
        metrics: dict[int, chat_pb2.TurnMetrics] = {}
        for part in read(self.events):
            if isinstance(part, chat_pb2.TokenDelta) and (a := answers[part.choice]).stops.matched is None:
                if part.HasField("logprob"):
                    a.scored.append(part)
                text = a.stops.feed(part.text)
                # once every answer matched a stop string, the rest is not wanted: stop the turn now
                if all(b.stops.matched is not None for b in answers):
                    self.backend.servicer.CancelTurn(chat_pb2.CancelTurnRequest(session_id=self.session_id),
                                                     self.call)
                if text:
                    yield a.delta(text, part.choice)
            elif isinstance(part, chat_pb2.TurnMetrics):
                metrics[part.choice] = part
            elif isinstance(part, chat_pb2.TurnFinal):
                choice = part.choice
                a = answers[choice]
                if a.stops.matched is None and (tail := a.stops.flush()):
                    yield a.delta(tail, choice)
                done = self._done(part, metrics.get(choice) or chat_pb2.TurnMetrics(), "".join(a.shown),
                                  a.stops.matched)
                yield dataclasses.replace(done, logprobs=tuple(a.scored), unsent_logprobs=tuple(a.scored[a.sent:]),
                                          choice=choice)
                if not choice:
                    return
        raise ServiceError(grpc.StatusCode.INTERNAL, "the turn's stream ended without its final event")

    def _done(self, final: chat_pb2.TurnFinal, metrics: chat_pb2.TurnMetrics, shown: str,
              matched: str | None) -> Done:
        rows = metrics.prompt_tokens + metrics.deferred_tokens    # this turn's input, deferred part included
        hit = metrics.cached_prompt_tokens                        # of those, served from the prefix cache
        generated = len(final.token_ids)
        usage = Usage(self.cached_tokens + rows, generated, self.cached_tokens + hit)
        if not final.choice:     # the prompt is counted once
            PROMPT_TOKENS.labels("cached").inc(usage.cached_tokens)
            PROMPT_TOKENS.labels("prefilled").inc(rows - hit)
        # the session continues answer 0: only its history becomes a tip (another answer's continuation
        # forks a session, which re-prefills the history, its pages found in the prefix cache)
        if matched is None and final.finish_reason in ("stop", "length") and not final.choice:
            conv = self.spec.conversation
            # the last sampled token is fed by the next turn: the session holds all but it
            context = usage.prompt_tokens + max(generated - 1, 0)
            self.backend.index.publish(self.owner, [*conv.digests, conv.digest_after(final.text)],
                                       Tip(self.session_id, context))
        reason = "stop" if matched is not None else final.finish_reason
        return Done(shown, reason, matched, usage, self.session_id, self.match, metrics)

    def close(self) -> None:
        self.call.end()
        # the frontend's end-of-stream bookkeeping runs now, not when the stream is garbage-collected; if a
        # thread is inside the stream (ValueError), the call cancelled above ends it there
        with contextlib.suppress(ValueError):
            self.events.close()
