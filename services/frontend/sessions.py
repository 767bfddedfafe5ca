"""Sessions as the frontend sees them: records in the store, opened and rebuilt on decode workers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import grpc
from google.protobuf import json_format

from raincheck_client._gen import chat_pb2

from .._gen import worker_pb2
from ..common.grpc_util import ServiceError, shown
from ..common.logs import bind
from ..common.recovery_modes import MODE_NAMES, MODES
from ..common.settings import FrontendSettings
from ..common.store import QuotaError, SessionRecord, Store, TurnRecord, WorkerInfo, digest
from .router import Router

log = logging.getLogger(__name__)
SESSION_ID_CHARS = 128    # ids are 32 hex digits; a longer one is unknown without asking the store
# OpenSession on a worker that fails these (it died and its registration has not lapsed yet, it drains,
# it hangs) is tried on another worker, up to OPEN_ATTEMPTS workers in all.
TRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
OPEN_ATTEMPTS = 3
TURN_LEASE_S = 600.0      # a running turn counts against its key this long at most (its frontend may die)


def _exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class Sessions:
    def __init__(self, store: Store, router: Router, settings: FrontendSettings):
        self.store = store
        self.router = router
        self.settings = settings
        self.timeout_s = settings.worker_timeout_s
        self.default_mode = settings.default_recovery_mode   # for sessions that do not ask for a recovery mode

    def owned(self, session_id: str, caller: str) -> SessionRecord:
        """The open session's record; NOT_FOUND if unknown or closed, PERMISSION_DENIED if not the caller's."""
        if not session_id:
            raise ServiceError.invalid("session_id is required")
        record = self.store.session(session_id) if len(session_id) <= SESSION_ID_CHARS else None
        if record is None:
            raise ServiceError.not_found(f"session {shown(session_id)} does not exist (or has expired)")
        if record.owner != caller:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, f"session {session_id} belongs to another API key")
        if record.closed:
            raise ServiceError.not_found(f"session {session_id} is closed")
        return record

    def begin_turn(self, caller: str) -> Callable[[], None]:
        """Count a turn against the caller's key (RESOURCE_EXHAUSTED at its limit); returns what ends it.
        Without API keys (caller "") nothing is counted."""
        if not caller:
            return lambda: None
        lease = uuid.uuid4().hex
        try:
            self.store.begin_turn(caller, lease, self.settings.max_turns_per_key, TURN_LEASE_S)
        except QuotaError as e:
            raise _exhausted(str(e)) from None
        return lambda: self.store.end_turn(caller, lease)

    def create(self, request: chat_pb2.CreateSessionRequest, caller: str) -> SessionRecord:
        """Open the session on the least-loaded worker (which validates its settings) and record it."""
        mode = (self.default_mode if request.recovery_mode == chat_pb2.RECOVERY_MODE_UNSPECIFIED
                else MODE_NAMES.get(request.recovery_mode))
        if mode is None:
            raise ServiceError.invalid(f"unknown recovery mode {request.recovery_mode}")
        limit = self.settings.max_sessions_per_key if caller else None   # no API keys: no quota
        if limit is not None and self.store.open_sessions(caller) >= limit:    # cheap check first
            raise _exhausted(f"this API key has {limit} open sessions, the limit: close one first")
        session_id = uuid.uuid4().hex
        worker, opened = self._open(request.model, mode, worker_pb2.OpenSessionRequest(
            session_id=session_id, deferral=request.deferral, recovery_mode=MODES[mode], owner=caller))
        record = SessionRecord(session_id, caller, worker.model, worker.worker_id,
                               json_format.MessageToDict(opened.deferral), mode)
        try:
            self.store.create_session(record, limit)
        except QuotaError as e:             # another frontend opened one meanwhile
            self._close_on(worker, session_id)
            raise _exhausted(str(e)) from None
        bind(log, session_id=session_id, worker_id=worker.worker_id).info("session created (%s recovery)", mode)
        return record

    def _open(self, model: str, mode: str, request: worker_pb2.OpenSessionRequest,
              exclude: frozenset[str] = frozenset()) -> tuple[WorkerInfo, worker_pb2.WorkerSession]:
        """OpenSession on the least-loaded worker; one that fails TRY_ELSEWHERE is passed over (here and,
        for a while, by the router) and the next one tried."""
        attempt = 1
        while True:
            worker = self.router.pick(model, mode, exclude)
            try:
                return worker, self.router.stub(worker).OpenSession(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                if attempt == OPEN_ATTEMPTS or e.code() not in TRY_ELSEWHERE:
                    raise
                bind(log, session_id=request.session_id, worker_id=worker.worker_id).warning(
                    "cannot open the session on worker %s (%s): trying another", worker.worker_id, e.code().name)
                self.router.failed(worker.worker_id)
                exclude |= {worker.worker_id}
                attempt += 1

    def _close_on(self, worker: WorkerInfo, session_id: str) -> None:
        try:
            self.router.stub(worker).CloseSession(worker_pb2.WorkerSessionRequest(session_id=session_id),
                                                  timeout=self.timeout_s)
        except grpc.RpcError as e:      # it is reaped when idle
            bind(log, session_id=session_id).warning("cannot close the session on its worker: %s", e.code().name)

    def rebuild(self, record: SessionRecord, exclude: frozenset[str] = frozenset()) -> WorkerInfo:
        """Reopen the session on a live worker, which re-prefills its logged turns with the next turn."""
        current = self.store.session(record.session_id)
        if current is None or current.closed:   # closed meanwhile (through another frontend)
            raise ServiceError.not_found(f"session {record.session_id} is closed")
        history = [self._history_turn(turn) for turn in self.store.turns(record.session_id)]
        deferral = json_format.ParseDict(record.deferral, chat_pb2.DeferralSettings())
        worker, _ = self._open(record.model, record.recovery_mode, worker_pb2.OpenSessionRequest(
            session_id=record.session_id, deferral=deferral, recovery_mode=MODES[record.recovery_mode],
            history=history, owner=record.owner), exclude)
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
                                       videos=[chat_pb2.Video(frames=[data(d) for d in v]) for v in turn.videos],
                                       render=json_format.ParseDict(turn.render, chat_pb2.RenderOptions()))
        return worker_pb2.HistoryTurn(message=message, answer_token_ids=turn.answer_token_ids,
                                      finish_reason=turn.finish_reason, answer_text=turn.answer_text)

    def log_turn(self, session_id: str, message: chat_pb2.UserMessage, final: chat_pb2.TurnFinal) -> None:
        """Append a completed turn to the log (images by content hash, their bytes as blobs), in one step
        with its images: a session closed meanwhile gets neither (closing is final)."""
        blobs = {digest(data): data for data in [*message.images, *(f for v in message.videos for f in v.frames)]}
        self.store.append_turn(session_id, TurnRecord(
            text=message.text, images=[digest(i) for i in message.images],
            videos=[[digest(f) for f in v.frames] for v in message.videos],
            answer_token_ids=list(final.token_ids), answer_text=final.text, finish_reason=final.finish_reason,
            render=json_format.MessageToDict(message.render),
        ), blobs)

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
