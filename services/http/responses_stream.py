"""A Responses API answer streamed: the server-sent events of a response, in OpenAI's order, from the pieces of
a session's turn or a tool chat's run."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from ..common.grpc_util import ServiceError
from . import tools
from .completions import Completion
from .errors import HttpError
from .responses_output import Outcome, entries, message_item, output_items, response_body, response_status, text_part
from .responses_request import ResponsesRequest, new_id
from .session_matching import Delta, Done, Turn
from .stops import StopMatcher


class _Events:
    """Events in order, each with its sequence number."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return event


async def stream_events(r: ResponsesRequest, rid: str, created: int,
                        pieces: AsyncIterator[tuple[str, list[dict]]],
                        outcome: Callable[[], Outcome], save: Callable[[dict, Outcome], None]
                        ) -> AsyncIterator[dict]:
    ev = _Events()
    shell = response_body(rid, r, created, "in_progress", [])
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    message_id, shown, opened = new_id("msg"), [], False

    def open_message() -> list[dict]:
        item = message_item(message_id, "", "in_progress", [])
        item["content"] = []
        return [ev("response.output_item.added", output_index=0, item=item),
                ev("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                   part=text_part("", []))]

    def delta(text: str, logprobs: list[dict]) -> dict:
        shown.append(text)
        return ev("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=text,
                  logprobs=logprobs)

    try:
        async for text, logprobs in pieces:
            if text:
                if not opened:
                    for e in open_message():
                        yield e
                    opened = True
                yield delta(text, logprobs)
        result = outcome()
    except ServiceError as e:
        err = HttpError.from_service(e)
        yield ev("error", code=err.code, message=err.message, param=None)
        # a failed response's error.code is one of OpenAI's few
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        yield ev("response.failed", response=response_body(rid, r, created, "failed", [],
                                                           error={"code": code, "message": err.message}))
        return
    streamed, full = "".join(shown), result.text or ""
    if full != streamed:        # text held back while it could have been a call: what was not is shown now
        rest = full[len(streamed):] if full.startswith(streamed) else ""
        result = dataclasses.replace(result, text=streamed + rest if streamed or rest else result.text)
    output = output_items(result, message_id)
    if output[0]["type"] == "message":
        if not opened:
            for e in open_message():
                yield e
        if rest := (result.text or "")[len(streamed):]:
            yield delta(rest, [])
        item = output[0]
        part = item["content"][0]
        yield ev("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=part["text"],
                 logprobs=part["logprobs"])
        yield ev("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=0, item=item)
    for index, item in enumerate(output):
        if item["type"] != "function_call":
            continue
        yield ev("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                         "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                 delta=item["arguments"])
        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                 name=item["name"], arguments=item["arguments"])
        yield ev("response.output_item.done", output_index=index, item=item)
    body = response_body(rid, r, created, response_status(result), output, result)
    await run_in_threadpool(save, body, result)      # stored before the client hears it is done
    yield ev(f"response.{body['status']}", response=body)


async def session_pieces(turn: Turn, holder: list[Done]) -> AsyncIterator[tuple[str, list[dict]]]:
    async for event in iterate_in_threadpool(turn.run()):
        if isinstance(event, Delta):
            yield event.text, entries(event.logprobs)
        else:
            holder.append(event)


async def tool_pieces(run: Completion) -> AsyncIterator[tuple[str, list[dict]]]:
    """The answer's text until a call may begin (the rest is settled at its end)."""
    before = StopMatcher([tools.OPEN], keep=True)
    async for text, _ in iterate_in_threadpool(run.pieces()):
        if before.matched is None and (shown := before.feed(text).removesuffix(tools.OPEN)):
            yield shown, []
