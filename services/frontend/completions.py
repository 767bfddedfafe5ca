"""The ChatService calls that need a worker serving the model but no session: completions and the
tokenizer. Each goes to the least-loaded worker serving the model; a completion counts as a turn against
the caller's key while it streams."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from raincheck_client._gen import chat_pb2

from .sessions import Sessions


def complete(sessions: Sessions, caller: str, request: chat_pb2.CompleteRequest, context: grpc.ServicerContext
             ) -> Iterator[chat_pb2.ChatEvent]:
    """Start the completion on a worker and wait for its first event (errors raise here)."""
    end_turn = sessions.begin_turn(caller)
    try:
        worker = sessions.router.pick(request.model, sessions.default_mode)
        call = sessions.router.stub(worker).Complete(request)
        if not context.add_callback(call.cancel):     # the client has gone already
            call.cancel()
        first = next(call)
    except BaseException:
        end_turn()
        raise
    return _relay(first, call, end_turn)


def _relay(first: chat_pb2.ChatEvent, call, end_turn) -> Iterator[chat_pb2.ChatEvent]:
    try:
        yield first
        yield from call
    except grpc.RpcError as e:    # the worker failed mid-stream: tell the client in the stream
        if e.code() != grpc.StatusCode.CANCELLED:
            yield chat_pb2.ChatEvent(error=chat_pb2.ErrorEvent(
                code=e.code().name, message=f"decode worker failed during the completion: {e.details()}"))
    finally:
        end_turn()


def ask(sessions: Sessions, method: str,
        request: chat_pb2.TokenizeRequest | chat_pb2.DetokenizeRequest | chat_pb2.TokenizerInfoRequest,
        timeout_s: float) -> chat_pb2.TokenizeResponse | chat_pb2.DetokenizeResponse | chat_pb2.TokenizerInfoResponse:
    """A unary tokenizer call on a worker serving `request.model`."""
    worker = sessions.router.pick(request.model, sessions.default_mode)
    return getattr(sessions.router.stub(worker), method)(request, timeout=timeout_s)
