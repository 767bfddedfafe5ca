"""A chat completion with tools (tools.py): one stateless completion of the rendered chat, answered in
OpenAI's chat shape, with `tool_calls` (and finish_reason `tool_calls`) when the answer holds calls.
Streamed, the content before the first `<tool_call>` streams as it comes; the calls follow as
`tool_calls` deltas, one per call (id, name and the whole arguments), once the answer is complete. The
same path answers chats that continue a final assistant message or render no assistant prompt."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import iterate_in_threadpool

from raincheck_client._gen import chat_pb2

from . import completions, openai_api
from .call import HttpCall
from .images import ImageLoader
from .sampling_fields import render_options, sampling_options, stop_strings
from .sse import EventStream
from .stops import StopMatcher
from .tools import OPEN, ToolChat, split_calls, tool_chat

if TYPE_CHECKING:
    from ..frontend.servicer import ChatServicer


async def start(body: openai_api.ChatCompletionRequest, call: HttpCall, servicer: ChatServicer,
                blocking: Callable[..., Awaitable], images: ImageLoader) -> tuple[ToolChat, completions.Completion]:
    """Check the request, load its images and start the completion (errors raise here, the call ended)."""
    try:
        chat = await tool_chat(body, images)
        sampling = sampling_options(body, openai_api.max_tokens(body), False, 0)
        sampling.grammar = chat.grammar or ""
        request = chat_pb2.CompleteRequest(
            model=body.model, messages_json=chat.messages_json, tools_json=chat.tools_json, sampling=sampling,
            continue_final_message=chat.continue_final, images=chat.images, render=render_options(body),
            add_generation_prompt=None if body.add_generation_prompt else False)
        stops = StopMatcher(stop_strings(body.stop), keep=body.include_stop_str_in_output)
        return chat, completions.Completion(0, call, await blocking(servicer.Complete, request, call), stops, False)
    except BaseException:
        call.end()
        raise


async def respond(body: openai_api.ChatCompletionRequest, call: HttpCall, servicer: ChatServicer,
                  blocking: Callable[..., Awaitable], images: ImageLoader) -> dict[str, Any] | EventStream:
    chat, run = await start(body, call, servicer, blocking, images)
    cid, model = openai_api.completion_id(body.request_id), body.model
    if not body.stream:
        try:
            await blocking(run.run)
        finally:
            call.end()
        content, calls = split_calls(run.text, chat.parallel)
        if chat.echo:
            content = chat.echo + (content or "")
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if calls else run.finish_reason}],
                "usage": completions.usage([run])}
    return EventStream(_chunks(cid, model, run, chat, openai_api.include_usage(body)), run.call.end)


async def _chunks(cid: str, model: str, run: completions.Completion, chat: ToolChat, with_usage: bool
                  ) -> AsyncIterator[dict]:
    created = int(time.time())

    def chunk(delta: dict | None, finish: str | None = None, **extra: Any) -> dict:
        return openai_api.chunk_body(cid, model, created, delta, finish, **extra)

    before = StopMatcher([OPEN], keep=True)     # content streams until a call may begin
    sent = 0
    yield chunk({"role": "assistant", "content": chat.echo})
    async for text, _ in iterate_in_threadpool(run.pieces()):
        if before.matched is None and (shown := before.feed(text).removesuffix(OPEN)):
            sent += len(shown)
            yield chunk({"content": shown})
    _, calls = split_calls(run.text, chat.parallel)
    if not calls and run.text[sent:]:       # no call after all (or one cut short): the rest is content
        yield chunk({"content": run.text[sent:]})
    for i, c in enumerate(calls):
        yield chunk({"tool_calls": [{"index": i, **c}]})
    yield chunk({}, "tool_calls" if calls else run.finish_reason)
    if with_usage:
        yield chunk(None, usage=completions.usage([run]))
