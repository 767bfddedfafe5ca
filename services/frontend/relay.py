"""One Chat turn through the frontend: start it on the session's worker (rebuilding the session there
first if its worker is gone), relay the events, log the completed turn."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from raincheck_client._gen import chat_pb2

from .._gen import worker_pb2
from ..common.events import payload
from ..common.logs import bind
from ..common.metrics import TurnTimer
from ..common.store import SessionRecord
from .sessions import Sessions

log = logging.getLogger(__name__)
# A worker answering these for a session the store says is open has lost it (restart, idle reaping), or
# cannot be reached: the session is rebuilt on a live worker and the turn retried once.
LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


def start(sessions: Sessions, record: SessionRecord, request: chat_pb2.ChatRequest,
          context: grpc.ServicerContext) -> Iterator[chat_pb2.ChatEvent]:
    """Start the turn and wait for its first event (errors raise here, before the stream begins)."""
    turn_id = f"{record.session_id}/{record.turns}"
    forward = worker_pb2.TurnRequest(
        session_id=record.session_id, turn_id=turn_id, message=request.message, sampling=request.sampling,
        deferral=request.deferral if request.HasField("deferral") else None,
        follow_recovery=request.follow_recovery,
    )
    tlog = bind(log, session_id=record.session_id, turn_id=turn_id)
    timer = TurnTimer("frontend")
    worker = sessions.router.owner(record.worker_id) or sessions.rebuild(record)
    for attempt in (1, 2):
        call = sessions.router.stub(worker).Turn(forward)
        if not context.add_callback(call.cancel):   # the client has gone already
            call.cancel()
        try:
            first = next(call)
            break
        except grpc.RpcError as e:
            if attempt == 2 or e.code() not in LOST:
                raise
            tlog.warning("worker %s lost the session (%s): rebuilding it", worker.worker_id, e.code().name)
            gone = frozenset()
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                sessions.router.failed(worker.worker_id)
                gone = frozenset({worker.worker_id})
            worker = sessions.rebuild(record, exclude=gone)
    tlog.info("turn started on worker %s", worker.worker_id)
    return _relay(sessions, record.session_id, request.message, first, call, timer, tlog)


def _relay(sessions: Sessions, session_id: str, message: chat_pb2.UserMessage, first: chat_pb2.ChatEvent,
           call, timer: TurnTimer, tlog: logging.LoggerAdapter) -> Iterator[chat_pb2.ChatEvent]:
    event = first
    try:
        while True:
            part = payload(event)
            if isinstance(part, chat_pb2.TokenDelta):
                timer.token()
            elif isinstance(part, chat_pb2.TurnFinal) and not part.choice:   # the answer the session continues
                timer.done()
                sessions.log_turn(session_id, message, part)
            yield event
            event = next(call)
    except StopIteration:
        return
    except grpc.RpcError as e:   # the worker failed mid-stream: tell the client in the stream
        if e.code() == grpc.StatusCode.CANCELLED:
            return
        tlog.warning("worker stream failed: %s %s", e.code().name, e.details())
        yield chat_pb2.ChatEvent(turn_id=first.turn_id, error=chat_pb2.ErrorEvent(
            code=e.code().name, message=f"decode worker failed during the turn: {e.details()}"))
