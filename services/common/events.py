"""The ChatEvent stream a decode worker sends (chat.proto), read in one place: each event's payload as its
own protobuf type (TokenDelta, TurnMetrics, TurnFinal, RecoveryProgress, PromptTokens, ErrorEvent).

`payload` is for a relay that passes the events on (an error event is its client's to read); `read` is
for a consumer: an error event raises ServiceError there, with the worker's status code and message."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc

from raincheck_client._gen import chat_pb2

from .grpc_util import ServiceError

Payload = (chat_pb2.TokenDelta | chat_pb2.TurnMetrics | chat_pb2.TurnFinal | chat_pb2.RecoveryProgress
           | chat_pb2.PromptTokens | chat_pb2.ErrorEvent)


def payload(event: chat_pb2.ChatEvent) -> Payload | None:
    """What the event carries (None: nothing, an event from a newer worker this one does not know)."""
    kind = event.WhichOneof("event")
    return getattr(event, kind) if kind is not None else None


def read(events: Iterable[chat_pb2.ChatEvent]) -> Iterator[Payload]:
    """Each event's payload, in order; an error event raises ServiceError (its code, else INTERNAL)."""
    for event in events:
        part = payload(event)
        if isinstance(part, chat_pb2.ErrorEvent):
            raise ServiceError(getattr(grpc.StatusCode, part.code, grpc.StatusCode.INTERNAL), part.message)
        if part is not None:
            yield part
