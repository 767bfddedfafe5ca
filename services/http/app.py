"""The ASGI app: OpenAI routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, and `/v1/responses`:
responses_api.py), SGLang routes (`/generate`, `/get_model_info`), the tokenizer's (tokenizer_api.py), `/metrics`
and `/health`, over one ChatBackend (the frontend's ChatService + the session index); CORS where
`--allowed-origins` names origins.

Calls into the frontend block (gRPC to the workers), so they run in worker threads; a streamed answer
holds a thread only while it waits for its next event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import Message

from ..common.grpc_util import ServiceError
from ..common.metrics import REQUESTS
from . import completions, openai_api, responses_api, sglang_api, tokenizer_api, tool_chat, tools
from .call import HttpCall
from .errors import HttpError
from .images import ImageLoader
from .response_format import naming_field
from .response_store import make_responses
from .session_matching import ChatBackend, Delta, Done, Turn
from .settings import HttpSettings
from .sse import EventStream

log = logging.getLogger(__name__)
T = TypeVar("T")


class BodyLimit:
    """413 for a request body over `limit` bytes, found before it is held in memory whole."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = JSONResponse(HttpError(413, f"the request body is over {self.limit} bytes, the limit").body(),
                               status_code=413)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await refusal(scope, receive, send)
        received, over = 0, False

        async def limited() -> Message:    # a body sent without its length is counted as it arrives
            nonlocal received, over
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:      # the app sees the client leave; the refusal is sent instead
                over = True
                return {"type": "http.disconnect"}
            return message

        async def unless_over(message: Message) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, limited, unless_over)
        except Exception:
            if not over:
                raise
        if over:
            await refusal(scope, receive, send)


# pydantic's error type -> the error's code (OpenAI's names)
_VALIDATION_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter",
                     "json_invalid": "invalid_json", "model_attributes_type": "invalid_json"}   # not an object


def invalid_body(errors: list[dict]) -> HttpError:
    """A request body that does not validate: every problem in the message, the first named as param and code
    (`unknown_parameter` for a field no list declares, `missing_required_parameter`, `invalid_json`, else
    `invalid_type`)."""
    def where(err: dict) -> str:
        return ".".join(str(x) for x in err["loc"][1:])

    problems = "; ".join(f"{where(err) or 'body'}: {err['msg']}" for err in errors)
    first = errors[0] if errors else {"type": "", "loc": ()}
    return HttpError.invalid(f"invalid request: {problems}", param=where(first) or None,
                             code=_VALIDATION_CODES.get(first["type"], "invalid_type"))


def build_app(backend: ChatBackend, settings: HttpSettings, max_image_bytes: int, max_body_bytes: int) -> FastAPI:
    images = ImageLoader(max_image_bytes, settings.image_urls, settings.image_fetch_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.threads
        yield

    app = FastAPI(title="Raincheck Serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if settings.allowed_origins:    # outermost: a refusal (401, 413, ...) carries the headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"], max_age=600)

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, e: HttpError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return JSONResponse(invalid_body(e.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _starlette(request: Request, e: HTTPException):
        return JSONResponse(HttpError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable):
        response = await call_next(request)
        route = request.scope.get("route")
        REQUESTS.labels("http", route.path if route is not None else "other", str(response.status_code)).inc()
        return response

    async def blocking(fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking frontend call; its ServiceError becomes the matching HTTP error."""
        try:
            return await run_in_threadpool(fn, *args)
        except ServiceError as e:
            raise HttpError.from_service(e) from None

    async def start(request: Request, spec_of: Callable) -> Turn:
        call = HttpCall.of(request)
        try:
            owner = await blocking(backend.owner, call)
            spec = await spec_of()
            try:
                return await blocking(backend.start, call, owner, spec)
            except HttpError as e:
                raise naming_field(e, spec.grammar_field) from None
        except BaseException:
            call.end()
            raise

    async def finish(turn: Turn) -> list[Done]:
        """Run a turn to its end (non-streaming responses): each answer's Done, by choice."""
        def run() -> list[Done]:
            return sorted((e for e in turn.run() if isinstance(e, Done)), key=lambda d: d.choice)
        try:
            return await blocking(run)
        finally:
            turn.close()

    def stream(turn: Turn, chunks: Callable[[Delta | Done], list[dict]], opening: tuple[dict, ...] = ()
               ) -> EventStream:
        """The turn as server-sent events: `opening`, then each event's chunks (text as it is, not escaped)."""
        async def each() -> AsyncIterator[dict]:
            async for event in iterate_in_threadpool(turn.run()):
                for chunk in chunks(event):
                    yield chunk
        return EventStream(each(), turn.close, opening=opening, ensure_ascii=False)

    # -- OpenAI --------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: openai_api.ChatCompletionRequest, request: Request
                               ) -> dict[str, Any] | EventStream:
        if tools.uses_tools(body):
            return await tool_chat.respond(body, HttpCall.of(request), backend.servicer, blocking, images)
        turn = await start(request, lambda: openai_api.to_spec(body, images))
        cid, model = openai_api.completion_id(body.request_id), body.model
        if not body.stream:
            return openai_api.completion_body(cid, model, await finish(turn), bool(body.logprobs))
        created, usage_chunk = int(time.time()), openai_api.include_usage(body)
        dones: list[Done] = []

        def chunks(event: Delta | Done) -> list[dict]:
            if isinstance(event, Delta):
                return [openai_api.chunk_body(cid, model, created, {"content": event.text}, logprobs=event.logprobs,
                                              choice=event.choice)]
            dones.append(event)
            out = [openai_api.chunk_body(cid, model, created, {}, event.finish_reason, event.unsent_logprobs,
                                         choice=event.choice, raincheck=event.details())]
            if usage_chunk and not event.choice:     # answer 0's Done is the last
                usage = openai_api.usage_body(sorted(dones, key=lambda d: d.choice))
                out.append(openai_api.chunk_body(cid, model, created, None, usage=usage))
            return out

        opening = tuple(openai_api.chunk_body(cid, model, created, {"role": "assistant", "content": ""}, choice=i)
                        for i in range(body.n or 1))
        return stream(turn, chunks, opening)

    @app.get("/v1/models", response_model=None)
    async def list_models(request: Request) -> dict[str, Any]:
        await blocking(backend.owner, HttpCall.of(request))
        return openai_api.models_body(await blocking(backend.model_times))

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: completions.CompletionRequest, request: Request
                                ) -> dict[str, Any] | EventStream:
        return await completions.respond(body, lambda: HttpCall.of(request), backend.servicer, blocking)

    @app.get("/v1/models/{model:path}", response_model=None)
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        await blocking(backend.owner, HttpCall.of(request))
        served = await blocking(backend.model_times)
        if model not in served:
            raise HttpError(404, f"the model {model!r} does not exist (served: {', '.join(served)})",
                            param="model", code="model_not_found")
        return openai_api.model_body(model, served[model])

    responses_api.add_routes(app, backend, make_responses(backend.store), images, blocking, start, finish)

    # -- SGLang --------------------------------------------------------------------------------------------
    async def sglang_model(requested: str | None) -> str:
        if requested:
            return requested
        served = await blocking(backend.models)
        if len(served) != 1:
            raise HttpError(404 if not served else 400,
                            "no model is served" if not served else
                            f"several models are served ({', '.join(served)}): add \"model\" to the request")
        return served[0]

    @app.post("/generate", response_model=None)
    async def generate(body: sglang_api.GenerateRequest, request: Request
                       ) -> dict[str, Any] | list[dict[str, Any]] | EventStream:
        if sglang_api.scoring(body):
            return await score(body, request)
        if sglang_api.prefill_only(body):
            await blocking(backend.owner, HttpCall.of(request))
            sglang_api.check(body)
            count = sglang_api.count_request(body, await sglang_model(body.model))
            tokens = await blocking(backend.servicer.Tokenize, count, HttpCall.of(request)) if count else None
            return sglang_api.prefill_only_body(body.rid, len(tokens.token_ids) if tokens else 0)
        model = await sglang_model(body.model)
        turn = await start(request, lambda: sglang_api.to_spec(body, model, images, settings.sglang_max_new_tokens))
        if not body.stream:
            return sglang_api.generate_body((await finish(turn))[0], body.rid)
        rid, text = body.rid or turn.session_id, []

        def chunks(event: Delta | Done) -> list[dict]:
            if isinstance(event, Done):
                return [sglang_api.generate_body(event, rid)]
            text.append(event.text)
            return [sglang_api.partial_body("".join(text), rid)]

        return stream(turn, chunks)

    async def score(body: sglang_api.GenerateRequest, request: Request) -> dict | list[dict]:
        """SGLang's scoring: each prompt's logprobs by a stateless completion of its own, one after another."""
        wanted = sglang_api.score_requests(body, await sglang_model(body.model))
        answers = []
        for one in wanted:
            call = HttpCall.of(request)
            try:
                events = await blocking(backend.servicer.Complete, one, call)
                answers.append(sglang_api.score_body(await blocking(sglang_api.prompt_of, events), body))
            finally:
                call.end()
        return answers if sglang_api.batched(body) else answers[0]

    @app.get("/get_model_info", response_model=None)
    async def get_model_info(request: Request, model: str | None = None) -> dict[str, Any]:
        await blocking(backend.owner, HttpCall.of(request))
        return sglang_api.model_info(await sglang_model(model))

    # -- the tokenizer, metrics, health ----------------------------------------------------------------------
    tokenizer_api.add_routes(app, backend.servicer, blocking)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        served = await blocking(backend.models)
        status = 200 if served else 503
        return JSONResponse({"status": "ok" if served else "no healthy decode worker", "models": served},
                            status_code=status)

    return app
