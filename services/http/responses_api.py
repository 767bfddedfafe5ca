"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET /v1/responses/{id}`, `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, in the shapes of the openai package's
`openai.types.responses`.

A request is turned into the chat it stands for and answered by the chat completions' own paths: its
`instructions` a system message, then the conversation of its `previous_response_id` (response_store.py), then
its `input` items (messages with input_text and input_image parts, function_call and function_call_output
items); `tools` (function tools), `tool_choice`, `text.format` (as response_format) and the sampling fields
map onto the chat's. So a conversation continued with `previous_response_id` is matched to sessions like any
chat (session_matching.py) and continues the session that answered the previous response: only the new input
is prefilled (`usage.input_tokens_details.cached_tokens` is the rest); a chat with tools runs as a stateless
tool chat (tool_chat.py), its calls returned as `function_call` items. What each request field does is
openai_fields.RESPONSES.

Output: a `message` item with one `output_text` part (with `logprobs` when included), and `function_call`
items; status `completed`, or `incomplete` (reason `max_output_tokens`) when the answer reached its length
limit. Streamed, as named server-sent events: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done` (a function call:
`response.function_call_arguments.delta` and `.done`), and last `response.completed` (or
`response.incomplete`); a failure after the stream began is an `error` event and `response.failed`.

This module holds the routes; the request and the chat it stands for are responses_request.py, the output
and the response body responses_output.py, the streamed events responses_stream.py.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from fastapi import FastAPI, Request

from . import openai_fields, tool_chat, tools
from .call import HttpCall
from .errors import HttpError
from .images import ImageLoader
from .openai_api import to_spec
from .response_store import ResponseStore, StoredResponse
from .responses_output import (
    Outcome,
    answer_messages,
    output_items,
    response_body,
    response_status,
    session_outcome,
    tool_outcome,
)
from .responses_request import IMAGE_REF, Conversation, ResponsesRequest, chat_request, conversation, data_url, new_id
from .responses_stream import session_pieces, stream_events, tool_pieces
from .session_matching import ChatBackend, Done, Turn
from .sse import EventStream


def add_routes(app: FastAPI, backend: ChatBackend, responses: ResponseStore, images: ImageLoader,
               blocking: Callable[..., Awaitable], start: Callable[..., Awaitable[Turn]],
               finish: Callable[[Turn], Awaitable[list[Done]]]) -> None:
    store = backend.store

    async def owned(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
        owner = await blocking(backend.owner, HttpCall.of(request))
        found = await blocking(responses.get, response_id)
        if found is None or found.owner != owner:      # another key's is as good as none
            raise HttpError(404, f"no response with id {response_id!r} (it may have expired, been deleted or not "
                            "been stored)", param=param, code="not_found")
        return found

    def saver(r: ResponsesRequest, owner: str, conv: Conversation) -> Callable[[dict, Outcome], None]:
        def save(body: dict, outcome: Outcome) -> None:
            if r.store is False:
                return
            for data in conv.images.values():        # kept while a session's log names them, else 10 min
                store.put_blob(data)
            responses.put(StoredResponse(body["id"], owner, body, [*conv.history, *conv.new,
                                                                   *answer_messages(outcome)],
                                         r.instructions, conv.items))
        return save

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: ResponsesRequest, request: Request) -> dict[str, Any] | EventStream:
        try:
            return await create(body, request)
        except HttpError as e:
            raise _named_as_responses(e) from None

    async def create(body: ResponsesRequest, request: Request) -> dict[str, Any] | EventStream:
        owner = await blocking(backend.owner, HttpCall.of(request))
        openai_fields.check(body, openai_fields.RESPONSES)
        previous = None
        if body.previous_response_id is not None:
            previous = await owned(request, body.previous_response_id, "previous_response_id")
        conv = await conversation(body, previous, images, lambda digest: blocking(store.blob, digest))
        chat = chat_request(body, conv)
        rid, created, save = new_id("resp"), int(time.time()), saver(body, owner, conv)
        if tools.uses_tools(chat):
            found, run = await tool_chat.start(chat, HttpCall.of(request), backend.servicer, blocking, images)
            if body.stream:
                return EventStream(stream_events(body, rid, created, tool_pieces(run), lambda: tool_outcome(run, found),
                                           save), run.call.end, typed=True)
            try:
                await blocking(run.run)
            finally:
                run.call.end()
            outcome = tool_outcome(run, found)
        else:
            turn = await start(request, lambda: to_spec(chat, images))
            if body.stream:
                dones: list[Done] = []
                return EventStream(stream_events(body, rid, created, session_pieces(turn, dones),
                                           lambda: session_outcome(dones[0]), save), turn.close, typed=True)
            outcome = session_outcome((await finish(turn))[0])
        reply = response_body(rid, body, created, response_status(outcome), output_items(outcome, new_id("msg")),
                              outcome)
        await blocking(save, reply, outcome)
        return reply

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def retrieve_response(response_id: str, request: Request, stream: bool = False) -> dict[str, Any]:
        if stream:
            raise HttpError.unsupported("stream is not supported here: a stored response is returned whole",
                                        param="stream")
        return (await owned(request, response_id)).body

    @app.delete("/v1/responses/{response_id}", response_model=None)
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        await owned(request, response_id)
        await blocking(responses.delete, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel", response_model=None)
    async def cancel_response(response_id: str, request: Request) -> NoReturn:
        await owned(request, response_id)
        raise HttpError(400, "only background responses can be cancelled, and this server runs none",
                        code="unsupported_parameter")

    @app.get("/v1/responses/{response_id}/input_items", response_model=None)
    async def input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> dict[str, Any]:
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise HttpError.invalid("order is asc or desc, limit 1-100", param="order" if order not in
                                    ("asc", "desc") else "limit")
        stored = await owned(request, response_id)
        items = await blocking(lambda: [_readable(item, store.blob) for item in stored.input_items])
        items = items[::-1] if order == "desc" else items
        ids = [item["id"] for item in items]
        begin = ids.index(after) + 1 if after in ids else 0
        page = items[begin:begin + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": begin + limit < len(items)}


# the chat fields a response's fields become, by the response's names (for the errors the chat paths raise)
_CHAT_NAMES = {"response_format": "text.format", "logprobs": "include", "max_completion_tokens": "max_output_tokens",
               "messages": "input"}


def _named_as_responses(e: HttpError) -> HttpError:
    """An error of the chat paths, naming the responses field the chat field came from."""
    name = (e.param or "").split("[")[0].split(".")[0]
    if name not in _CHAT_NAMES:
        return e
    ours = _CHAT_NAMES[name]
    # the whole chat path: a schema's path inside response_format has no counterpart in text.format
    message = e.message if name == "messages" else e.message.replace(e.param or name, ours, 1)
    return HttpError(e.status, message, type=e.type, code=e.code, param=ours if name != "messages" else "input")


def _readable(item: dict, blob: Callable[[str], bytes | None]) -> dict:
    """A stored input item with its images as data URLs again (None where the image has expired)."""
    def part(p: dict) -> dict:
        if p.get("type") != "input_image":
            return p
        data = blob(p["image_url"].removeprefix(IMAGE_REF))
        return {**p, "image_url": data_url(data) if data is not None else None}

    parts = item.get("content") if item["type"] == "message" else item.get("output")
    if not isinstance(parts, list):
        return item
    key = "content" if item["type"] == "message" else "output"
    return {**item, key: [part(p) for p in parts]}
