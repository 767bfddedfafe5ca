"""Server-sent events, written in one place for every streamed answer of the HTTP API (chat completions,
tool chats, completions, SGLang's /generate, responses): `data: <json>` per chunk, a failure mid-answer as an
error chunk, then `data: [DONE]`; or, for the Responses API, each chunk as a named event (`event: <its
type>`), with no `[DONE]` (its last event says the response is over)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable

import anyio
from fastapi.responses import StreamingResponse

from ..common.grpc_util import ServiceError
from .errors import HttpError

DONE = "data: [DONE]\n\n"


def data(chunk: dict, ensure_ascii: bool = True) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=ensure_ascii)}\n\n"


def named(chunk: dict, ensure_ascii: bool = True) -> str:
    """A chunk as an event named by its `type` (the Responses API's framing)."""
    return f"event: {chunk['type']}\n" + data(chunk, ensure_ascii)


async def _events(chunks: AsyncIterable[dict], end: Callable[[], None], opening: Iterable[dict],
                  ensure_ascii: bool, typed: bool) -> AsyncIterator[str]:
    frame = named if typed else data
    try:
        for chunk in opening:
            yield frame(chunk)
        async for chunk in chunks:
            yield frame(chunk, ensure_ascii)
    except ServiceError as e:
        yield data(HttpError.from_service(e).body())
    finally:
        end()
    if not typed:
        yield DONE


class EventStream(StreamingResponse):
    """`opening`, each of `chunks`, then `[DONE]`; a ServiceError while `chunks` runs becomes an error chunk
    before `[DONE]`, and `end()` runs however the stream ends (answered, failed, or the client gone).
    `ensure_ascii` is json.dumps' for `chunks` (the opening and an error chunk are always ASCII). `typed`: each
    chunk is an event named by its `type`, and no `[DONE]` follows (the Responses API's streams).

    The stream stops as soon as the client goes away, so that its turn is cancelled at once (Starlette
    watches for the disconnect only under ASGI < 2.4, and uvicorn drops writes to a closed connection
    without an error)."""

    def __init__(self, chunks: AsyncIterable[dict], end: Callable[[], None], *, opening: Iterable[dict] = (),
                 ensure_ascii: bool = True, typed: bool = False):
        super().__init__(_events(chunks, end, opening, ensure_ascii, typed), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            await self.stream_response(send)
            group.cancel_scope.cancel()
