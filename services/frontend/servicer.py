"""The public ChatService: authenticate, check, route to the session's decode worker, relay."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import grpc

from raincheck_client._gen import chat_pb2, chat_pb2_grpc

from .._gen import worker_pb2
from ..common.grpc_util import ServiceError, rpc
from ..common.recovery_modes import MODES
from ..common.settings import FrontendSettings
from ..common.store import SessionRecord, Store
from . import completions, relay
from .auth import Auth
from .router import Router
from .sessions import Sessions
from .validate import check_message


def _translate(error: BaseException) -> ServiceError | None:
    """A decode worker's status, relayed as is."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return ServiceError(error.code(), error.details() or error.code().name)
    return None


frontend_rpc = rpc("frontend", _translate)


def _until_done(events: Iterator[chat_pb2.ChatEvent], done: Callable[[], None]) -> Iterator[chat_pb2.ChatEvent]:
    """`events`, then `done()` however the stream ends (finished, failed, or the client went away)."""
    try:
        yield from events
    finally:
        done()


class ChatServicer(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, settings: FrontendSettings, store: Store, router: Router):
        self.settings = settings
        self.store = store
        self.router = router
        self.auth = Auth(settings.api_keys)
        self.sessions = Sessions(store, router, settings)
        self.timeout_s = settings.worker_timeout_s

    @frontend_rpc
    def CreateSession(self, request: chat_pb2.CreateSessionRequest, context: grpc.ServicerContext
                      ) -> chat_pb2.SessionInfo:
        return self._describe(self.sessions.create(request, self.auth.identify(context)))

    @frontend_rpc
    def Chat(self, request: chat_pb2.ChatRequest, context: grpc.ServicerContext) -> Iterator[chat_pb2.ChatEvent]:
        caller = self.auth.identify(context)
        record = self.sessions.owned(request.session_id, caller)
        check_message(request.message, self.settings)
        end_turn = self.sessions.begin_turn(caller)
        try:
            events = relay.start(self.sessions, record, request, context)
        except BaseException:
            end_turn()
            raise
        return _until_done(events, end_turn)

    @frontend_rpc
    def GetSession(self, request: chat_pb2.GetSessionRequest, context: grpc.ServicerContext) -> chat_pb2.SessionInfo:
        return self._describe(self.sessions.owned(request.session_id, self.auth.identify(context)))

    @frontend_rpc
    def CloseSession(self, request: chat_pb2.CloseSessionRequest, context: grpc.ServicerContext
                     ) -> chat_pb2.CloseSessionResponse:
        record = self.sessions.owned(request.session_id, self.auth.identify(context))
        self._ask_worker(record, "CloseSession")
        self.store.close_session(record.session_id)
        return chat_pb2.CloseSessionResponse()

    @frontend_rpc
    def CancelTurn(self, request: chat_pb2.CancelTurnRequest, context: grpc.ServicerContext
                   ) -> chat_pb2.CancelTurnResponse:
        record = self.sessions.owned(request.session_id, self.auth.identify(context))
        return self._ask_worker(record, "CancelTurn") or chat_pb2.CancelTurnResponse(cancelled=False)

    @frontend_rpc
    def ListModels(self, request: chat_pb2.ListModelsRequest, context: grpc.ServicerContext
                   ) -> chat_pb2.ListModelsResponse:
        self.auth.identify(context)
        workers, modes = defaultdict(int), defaultdict(set)
        for w in self.store.workers():
            workers[w.model] += 1
            modes[w.model].update(w.recovery_modes)
        return chat_pb2.ListModelsResponse(models=[
            chat_pb2.ModelInfo(name=name, workers=n, recovery_modes=sorted(MODES[m] for m in modes[name]))
            for name, n in sorted(workers.items())
        ])

    @frontend_rpc
    def Complete(self, request: chat_pb2.CompleteRequest, context: grpc.ServicerContext
                 ) -> Iterator[chat_pb2.ChatEvent]:
        caller = self.auth.identify(context)
        if request.images:      # a chat's images: the limits of a message's
            check_message(chat_pb2.UserMessage(images=request.images), self.settings)
        return completions.complete(self.sessions, caller, request, context)

    @frontend_rpc
    def Tokenize(self, request: chat_pb2.TokenizeRequest, context: grpc.ServicerContext) -> chat_pb2.TokenizeResponse:
        self.auth.identify(context)
        return completions.ask(self.sessions, "Tokenize", request, self.timeout_s)

    @frontend_rpc
    def Detokenize(self, request: chat_pb2.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> chat_pb2.DetokenizeResponse:
        self.auth.identify(context)
        return completions.ask(self.sessions, "Detokenize", request, self.timeout_s)

    @frontend_rpc
    def TokenizerInfo(self, request: chat_pb2.TokenizerInfoRequest, context: grpc.ServicerContext
                      ) -> chat_pb2.TokenizerInfoResponse:
        self.auth.identify(context)
        return completions.ask(self.sessions, "TokenizerInfo", request, self.timeout_s)

    def _describe(self, record: SessionRecord) -> chat_pb2.SessionInfo:
        return self.sessions.describe(record, self._ask_worker(record, "GetSession"))

    def _ask_worker(self, record: SessionRecord, method: str):
        """`method` on the session's worker; None when the worker is gone or has lost the session."""
        worker = self.router.owner(record.worker_id)
        if worker is None:
            return None
        try:
            return getattr(self.router.stub(worker), method)(
                worker_pb2.WorkerSessionRequest(session_id=record.session_id), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() not in relay.LOST:
                raise
            return None
