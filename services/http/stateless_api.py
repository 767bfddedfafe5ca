"""The HTTP routes that need no session: OpenAI's `/v1/completions` and `/v1/models/{id}`, the
tokenizer's `/tokenize` and `/detokenize` (vLLM's and SGLang's shapes), and `/metrics` on the API port."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import iterate_in_threadpool

from raincheck_client._gen import chat_pb2

from ..common.grpc_util import ServiceError
from . import completions, openai_api
from .call import HttpCall
from .chat import ChatBackend
from .errors import HttpError
from .stops import StopMatcher


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    tokens: list[int] = Field(min_length=1)


def add_routes(app: FastAPI, backend: ChatBackend, blocking: Callable[..., Awaitable],
               event_stream: Callable[[AsyncIterator[str]], Response]) -> None:
    servicer = backend.servicer

    def call_of(request: Request) -> HttpCall:
        return HttpCall(request.headers.get("authorization"))

    @app.post("/v1/completions")
    async def create_completion(body: completions.CompletionRequest, request: Request):
        wanted = completions.requests_of(body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        runs: list[completions.Completion] = []
        try:
            for i, one in enumerate(wanted):     # each starts now: errors are the response's status
                call = call_of(request)
                runs.append(completions.Completion(i, call, await blocking(servicer.Complete, one, call),
                                                   StopMatcher(stop), body.logprobs is not None))
        except BaseException:
            for run in runs:
                run.call.end()
            raise
        cid = completions.completion_id()
        if not body.stream:
            try:
                async with anyio.create_task_group() as group:
                    for run in runs:
                        group.start_soon(blocking, run.run)
            finally:
                for run in runs:
                    run.call.end()
            return completions.body(cid, body.model, runs)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return event_stream(_stream(cid, body.model, runs, usage))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request):
        await blocking(backend.owner, call_of(request))
        served = await blocking(backend.models)
        if model not in served:
            raise HttpError(404, f"the model {model!r} does not exist (served: {', '.join(served)})",
                            param="model", code="model_not_found")
        return openai_api.models_body([model])["data"][0]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        reply = await blocking(servicer.Tokenize, chat_pb2.TokenizeRequest(
            model=body.model, text=body.prompt, add_special_tokens=body.add_special_tokens), call_of(request))
        ids = list(reply.token_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": reply.max_model_len,
                "token_strs": list(reply.tokens)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        reply = await blocking(servicer.Detokenize, chat_pb2.DetokenizeRequest(model=body.model, token_ids=body.tokens),
                               call_of(request))
        return {"prompt": reply.text, "text": reply.text}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _stream(cid: str, model: str, runs: list[completions.Completion], usage: bool) -> AsyncIterator[str]:
    """The prompts' completions one after another, as `text_completion` chunks, then usage and `[DONE]`."""
    created = int(time.time())
    try:
        for run in runs:
            async for text, logprobs in iterate_in_threadpool(run.pieces()):
                if text or logprobs:
                    choice = {"index": run.index, "text": text, "finish_reason": None, "logprobs": logprobs}
                    yield f"data: {json.dumps(completions.chunk(cid, model, created, [choice]))}\n\n"
            done = {"index": run.index, "text": "", "finish_reason": run.finish_reason, "logprobs": None}
            yield f"data: {json.dumps(completions.chunk(cid, model, created, [done]))}\n\n"
        if usage:
            yield f"data: {json.dumps(completions.chunk(cid, model, created, [], usage=completions.usage(runs)))}\n\n"
    except ServiceError as e:
        yield f"data: {json.dumps(HttpError.from_service(e).body())}\n\n"
    finally:
        for run in runs:
            run.call.end()
    yield "data: [DONE]\n\n"
