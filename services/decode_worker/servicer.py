"""The DecodeWorker gRPC service: RPCs -> WorkerRuntime, engine errors -> status codes."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from raincheck_client._gen import chat_pb2
from raincheck_core import RaincheckError

from .._gen import worker_pb2, worker_pb2_grpc
from ..common.grpc_util import ServiceError, rpc
from . import completions
from .convert import status_for
from .runtime import DrainingError, ModeUnavailableError, SessionExistsError, WorkerRuntime
from .tokenizer_info import tokenizer_info


def _translate(error: BaseException) -> ServiceError | None:
    if isinstance(error, ModeUnavailableError):
        return ServiceError.failed_precondition(str(error))
    if isinstance(error, DrainingError):
        return ServiceError.unavailable(str(error))
    if isinstance(error, SessionExistsError):
        return ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(error))
    if isinstance(error, RaincheckError):
        return ServiceError(status_for(error), str(error))
    return None


worker_rpc = rpc("decode_worker", _translate)


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime

    @worker_rpc
    def OpenSession(self, request: worker_pb2.OpenSessionRequest, context: grpc.ServicerContext
                    ) -> worker_pb2.WorkerSession:
        return self.runtime.describe(self.runtime.open(request))

    @worker_rpc
    def Turn(self, request: worker_pb2.TurnRequest, context: grpc.ServicerContext) -> Iterator[chat_pb2.ChatEvent]:
        events, rpc_ended = self.runtime.turn(request, context.is_active)
        if not context.add_callback(rpc_ended):   # the RPC already ended
            rpc_ended()
        return events

    @worker_rpc
    def GetSession(self, request: worker_pb2.WorkerSessionRequest, context: grpc.ServicerContext
                   ) -> worker_pb2.WorkerSession:
        return self.runtime.describe(self.runtime.get(request.session_id))

    @worker_rpc
    def CloseSession(self, request: worker_pb2.WorkerSessionRequest, context: grpc.ServicerContext
                     ) -> chat_pb2.CloseSessionResponse:
        self.runtime.close(request.session_id)
        return chat_pb2.CloseSessionResponse()

    @worker_rpc
    def CancelTurn(self, request: worker_pb2.WorkerSessionRequest, context: grpc.ServicerContext
                   ) -> chat_pb2.CancelTurnResponse:
        return chat_pb2.CancelTurnResponse(cancelled=self.runtime.cancel(request.session_id))

    @worker_rpc
    def Stats(self, request: worker_pb2.StatsRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerStats:
        return self.runtime.stats()

    @worker_rpc
    def Complete(self, request: chat_pb2.CompleteRequest, context: grpc.ServicerContext
                 ) -> Iterator[chat_pb2.ChatEvent]:
        return self.runtime.complete(request)

    @worker_rpc
    def Tokenize(self, request: chat_pb2.TokenizeRequest, context: grpc.ServicerContext) -> chat_pb2.TokenizeResponse:
        return completions.tokenize(self.runtime.engine, request)

    @worker_rpc
    def Detokenize(self, request: chat_pb2.DetokenizeRequest, context: grpc.ServicerContext
                   ) -> chat_pb2.DetokenizeResponse:
        return completions.detokenize(self.runtime.engine, request)

    @worker_rpc
    def TokenizerInfo(self, request: chat_pb2.TokenizerInfoRequest, context: grpc.ServicerContext
                      ) -> chat_pb2.TokenizerInfoResponse:
        return tokenizer_info(self.runtime.engine)
