"""Running one turn on the worker: engine events -> ChatEvents, recovery progress, metrics."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, SessionBusyError, TokenEvent, TurnEnd
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.engine import TurnStream

from .._gen import worker_pb2
from ..common.logs import bind
from ..common.metrics import ACCEPTED_TOKENS, BARRIER_WAIT, DRAFT_TOKENS, PREFIX_HIT_TOKENS, TurnTimer
from .convert import (
    error_event,
    final_event,
    metrics_event,
    progress_event,
    to_deferral,
    to_message,
    to_sampling,
    token_delta,
)
from .recovery import RecoveryBackend
from .replay import replay_prompt
from .sessions import WorkerSession

log = logging.getLogger(__name__)
FOLLOW_POLL_S = 0.02


def start_turn(engine: Engine, ws: WorkerSession, request: worker_pb2.TurnRequest, max_new_tokens: int
               ) -> TurnStream:
    """Validate and admit the turn (typed engine errors raise here); the returned stream runs it."""
    message = to_message(request.message)
    sampling = to_sampling(request.sampling, max_new_tokens)
    deferral: DeferralConfig | None = None
    if request.HasField("deferral"):
        deferral = to_deferral(request.deferral, ws.session.deferral)
    with ws.lock:
        if ws.active:
            raise SessionBusyError(f"session {ws.id} is still streaming its previous turn")
        turn_input = message
        if ws.history:
            turn_input = replay_prompt(engine, ws.history, message)
            deferral = rebuild_deferral(ws.history, deferral or ws.session.deferral)
        stream = ws.session.turn(turn_input, sampling, deferral=deferral)
        ws.history = []
        ws.stream, ws.active = stream, True
    return stream


def rebuild_deferral(history: list[worker_pb2.HistoryTurn], cfg: DeferralConfig) -> DeferralConfig:
    """The policy of the turn that re-prefills a rebuilt session's history in front of its new message.

    The lost cache held every past image whole (`raincheck` and `post_answer` recover what they defer;
    `full` defers nothing), so its history is admitted with nothing deferred: `full` for the whole turn,
    because the engine applies one policy per turn and cannot yet take the history apart from the new
    message. The new message's own images are then not pruned either, for this one turn (a slower first
    token, never a worse answer). Under `hard` the lost cache never had the pruned tokens: it stays `hard`."""
    has_visuals = any(turn.message.images or turn.message.videos for turn in history)
    if not has_visuals or cfg.policy in ("full", "hard"):
        return cfg
    return dataclasses.replace(cfg, policy="full")


def run_turn(ws: WorkerSession, stream: TurnStream, request: worker_pb2.TurnRequest, backend: RecoveryBackend,
             alive: Callable[[], bool]) -> Iterator[chat_pb2.ChatEvent]:
    """The turn's events: tokens (with progress when fused chunks shrink the deferred remainder), then
    metrics and the final event; then, with `follow_recovery`, progress until the remainder is done. With
    `n > 1` answers, each answer's events carry its choice, and answer 0's metrics and final come last."""
    turn_id = request.turn_id
    tlog = bind(log, session_id=ws.id, turn_id=turn_id)
    timer = TurnTimer("decode_worker")
    pending = None
    formatter = stream.session.engine.formatter
    decode = formatter.decode if formatter is not None else None
    last: list[chat_pb2.ChatEvent] = []     # answer 0's end: after every other answer's
    try:
        for event in stream:
            if isinstance(event, TokenEvent):
                timer.token()
                yield chat_pb2.ChatEvent(turn_id=turn_id, token=token_delta(event, decode))
                now = backend.pending(ws)
                if now != pending and (pending is not None or now):
                    pending = now
                    yield progress_event(turn_id, now)
            elif isinstance(event, TurnEnd) and event.choice:
                yield metrics_event(turn_id, event.metrics, event.choice)
                yield final_event(turn_id, event)
            elif isinstance(event, TurnEnd):
                timer.done()
                BARRIER_WAIT.observe(event.metrics.barrier_wait_s)
                PREFIX_HIT_TOKENS.inc(event.metrics.cached_prompt_tokens)
                DRAFT_TOKENS.inc(event.metrics.drafts_proposed)
                ACCEPTED_TOKENS.inc(event.metrics.drafts_accepted)
                if event.metrics.deferred_pending:   # not backend.pending: recovery may have finished already
                    backend.answer_done(ws)
                ws.release(stream)
                m = event.metrics
                tlog.info("turn done: %s, %d tokens, ttft %.3fs, e2e %.3fs, %d deferred pending",
                          event.finish_reason, m.generated_tokens, m.ttft_s, m.e2e_s, m.deferred_pending)
                last = [metrics_event(turn_id, event.metrics), final_event(turn_id, event)]
        yield from last
    except Exception as e:   # the engine failed the turn after it began: report it in the stream
        tlog.exception("turn failed")
        yield error_event(turn_id, e)
        return
    finally:
        ws.release(stream)
    if request.follow_recovery:
        yield from _follow(ws, backend, turn_id, alive)


def _follow(ws: WorkerSession, backend: RecoveryBackend, turn_id: str, alive: Callable[[], bool]
            ) -> Iterator[chat_pb2.ChatEvent]:
    t0 = time.perf_counter()
    last = None
    while alive() and not ws.session.closed:
        pending = backend.pending(ws)
        if pending != last:
            last = pending
            yield progress_event(turn_id, pending, time.perf_counter() - t0)
        if pending == 0:
            return
        time.sleep(FOLLOW_POLL_S)
