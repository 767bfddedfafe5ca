"""A chat completion with tools (tools.py): one stateless completion of the rendered chat, answered in
OpenAI's chat shape, with `tool_calls` (and finish_reason `tool_calls`) when the answer holds calls.
Streamed, the content before the first `<tool_call>` streams as it comes; the calls follow as
`tool_calls` deltas, one per call (id, name and the whole arguments), once the answer is complete."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Response
from starlette.concurrency import iterate_in_threadpool

from raincheck_client._gen import chat_pb2

from ..common.grpc_util import ServiceError
from . import completions, openai_api
from .call import HttpCall
from .errors import HttpError
from .sampling_fields import sampling_options
from .stops import StopMatcher
from .tools import OPEN, ToolChat, split_calls, tool_chat


async def respond(body: openai_api.ChatCompletionRequest, call: HttpCall, servicer,
                  blocking: Callable[..., Awaitable], event_stream: Callable[[AsyncIterator[str]], Response]):
    try:
        chat = tool_chat(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = sampling_options(body, max_tokens, False, 0)
        sampling.grammar = chat.grammar or ""
        request = chat_pb2.CompleteRequest(model=body.model, messages_json=chat.messages_json,
                                           tools_json=chat.tools_json, sampling=sampling,
                                           continue_final_message=chat.continue_final)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        run = completions.Completion(0, call, await blocking(servicer.Complete, request, call), StopMatcher(stop),
                                     False)
    except BaseException:
        call.end()
        raise
    cid, model = openai_api.completion_id(), body.model
    if not body.stream:
        try:
            await blocking(run.run)
        finally:
            call.end()
        content, calls = split_calls(run.text, chat.parallel)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if calls else run.finish_reason}],
                "usage": _usage(run)}
    usage = body.stream_options is not None and body.stream_options.include_usage
    return event_stream(_stream(cid, model, run, chat, usage))


def _usage(run: completions.Completion) -> dict:
    return {"prompt_tokens": run.prompt_tokens, "completion_tokens": run.completion_tokens,
            "total_tokens": run.prompt_tokens + run.completion_tokens}


async def _stream(cid: str, model: str, run: completions.Completion, chat: ToolChat, usage: bool
                  ) -> AsyncIterator[str]:
    created = int(time.time())

    def sse(delta: dict | None, finish: str | None = None, **extra) -> str:
        return f"data: {json.dumps(openai_api.chunk_body(cid, model, created, delta, finish, **extra))}\n\n"

    before = StopMatcher([OPEN], keep=True)     # content streams until a call may begin
    sent = 0
    try:
        yield sse({"role": "assistant", "content": ""})
        async for text, _ in iterate_in_threadpool(run.pieces()):
            if before.matched is None and (shown := before.feed(text).removesuffix(OPEN)):
                sent += len(shown)
                yield sse({"content": shown})
        _, calls = split_calls(run.text, chat.parallel)
        if not calls and run.text[sent:]:       # no call after all (or one cut short): the rest is content
            yield sse({"content": run.text[sent:]})
        for i, c in enumerate(calls):
            yield sse({"tool_calls": [{"index": i, **c}]})
        yield sse({}, "tool_calls" if calls else run.finish_reason)
        if usage:
            yield sse(None, usage=_usage(run))
    except ServiceError as e:
        yield f"data: {json.dumps(HttpError.from_service(e).body())}\n\n"
    finally:
        run.call.end()
    yield "data: [DONE]\n\n"
