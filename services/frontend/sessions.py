"""Sessions as the frontend sees them: records in the store, opened and rebuilt on decode workers."""

from __future__ import annotations

import logging
import uuid

import grpc
from google.protobuf import json_format

from raincheck_client._gen import chat_pb2

from .._gen import worker_pb2
from ..common.grpc_util import ServiceError
from ..common.logs import bind
from ..common.store import SessionRecord, Store, TurnRecord, WorkerInfo
from .router import Router

log = logging.getLogger(__name__)
MODES = {"colocated": chat_pb2.RECOVERY_MODE_COLOCATED, "disaggregated": chat_pb2.RECOVERY_MODE_DISAGGREGATED}
MODE_NAMES = {v: k for k, v in MODES.items()}


class Sessions:
    def __init__(self, store: Store, router: Router, timeout_s: float, default_mode: str):
        self.store = store
        self.router = router
        self.timeout_s = timeout_s
        self.default_mode = default_mode      # for sessions that do not ask for a recovery mode

    def owned(self, session_id: str, caller: str) -> SessionRecord:
        """The open session's record; NOT_FOUND if unknown or closed, PERMISSION_DENIED if not the caller's."""
        if not session_id:
            raise ServiceError.invalid("session_id is required")
        record = self.store.session(session_id)
        if record is None:
            raise ServiceError.not_found(f"session {session_id} does not exist (or has expired)")
        if record.owner != caller:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, f"session {session_id} belongs to another API key")
        if record.closed:
            raise ServiceError.not_found(f"session {session_id} is closed")
        return record

    def create(self, request: chat_pb2.CreateSessionRequest, caller: str) -> SessionRecord:
        """Open the session on the least-loaded worker (which validates its settings) and record it."""
        mode = (self.default_mode if request.recovery_mode == chat_pb2.RECOVERY_MODE_UNSPECIFIED
                else MODE_NAMES.get(request.recovery_mode))
        if mode is None:
            raise ServiceError.invalid(f"unknown recovery mode {request.recovery_mode}")
        worker = self.router.pick(request.model, mode)
        session_id = uuid.uuid4().hex
        opened = self.router.stub(worker).OpenSession(worker_pb2.OpenSessionRequest(
            session_id=session_id, deferral=request.deferral, recovery_mode=MODES[mode]), timeout=self.timeout_s)
        record = SessionRecord(session_id, caller, worker.model, worker.worker_id,
                               json_format.MessageToDict(opened.deferral), mode)
        self.store.create_session(record)
        bind(log, session_id=session_id, worker_id=worker.worker_id).info("session created (%s recovery)", mode)
        return record

    def rebuild(self, record: SessionRecord, exclude: frozenset[str] = frozenset()) -> WorkerInfo:
        """Reopen the session on a live worker, which re-prefills its logged turns with the next turn."""
        current = self.store.session(record.session_id)
        if current is None or current.closed:   # closed meanwhile (through another frontend)
            raise ServiceError.not_found(f"session {record.session_id} is closed")
        worker = self.router.pick(record.model, record.recovery_mode, exclude)
        history = [self._history_turn(turn) for turn in self.store.turns(record.session_id)]
        deferral = json_format.ParseDict(record.deferral, chat_pb2.DeferralSettings())
        self.router.stub(worker).OpenSession(worker_pb2.OpenSessionRequest(
            session_id=record.session_id, deferral=deferral, recovery_mode=MODES[record.recovery_mode],
            history=history), timeout=self.timeout_s)
        self.store.set_session_worker(record.session_id, worker.worker_id)
        record.worker_id = worker.worker_id
        bind(log, session_id=record.session_id, worker_id=worker.worker_id).warning(
            "session rebuilt from its turn log (%d turns)", len(history))
        return worker

    def _history_turn(self, turn: TurnRecord) -> worker_pb2.HistoryTurn:
        def data(digest: str) -> bytes:
            blob = self.store.blob(digest)
            if blob is None:
                raise ServiceError(grpc.StatusCode.DATA_LOSS,
                                   "the session's worker is gone and an image of its history has expired")
            return blob

        message = chat_pb2.UserMessage(text=turn.text, images=[data(d) for d in turn.images],
                                       videos=[chat_pb2.Video(frames=[data(d) for d in v]) for v in turn.videos])
        return worker_pb2.HistoryTurn(message=message, answer_token_ids=turn.answer_token_ids,
                                      finish_reason=turn.finish_reason, answer_text=turn.answer_text)

    def log_turn(self, session_id: str, message: chat_pb2.UserMessage, final: chat_pb2.TurnFinal) -> None:
        """Append a completed turn to the log (images by content hash, their bytes as blobs)."""
        put = self.store.put_blob
        self.store.append_turn(session_id, TurnRecord(
            text=message.text, images=[put(i) for i in message.images],
            videos=[[put(f) for f in v.frames] for v in message.videos],
            answer_token_ids=list(final.token_ids), answer_text=final.text, finish_reason=final.finish_reason,
        ))

    def describe(self, record: SessionRecord, live: worker_pb2.WorkerSession | None) -> chat_pb2.SessionInfo:
        info = chat_pb2.SessionInfo(
            session_id=record.session_id, model=record.model, recovery_mode=MODES[record.recovery_mode],
            deferral=json_format.ParseDict(record.deferral, chat_pb2.DeferralSettings()), turns=record.turns,
            worker_id=record.worker_id, status=chat_pb2.SESSION_STATUS_DETACHED,
        )
        if live is not None:
            info.status = live.status
            info.pending_deferred_tokens = live.pending_deferred_tokens
            info.cached_tokens = live.cached_tokens
        return info
