"""OpenAI's legacy completions (`/v1/completions`): prompts as strings or token ids, no chat template,
no session (the frontend's Complete RPC); `echo` puts the prompt in front of the answer, with its
logprobs when asked (lm-eval's loglikelihood: `echo`, `logprobs`, `max_tokens` 0 or 1). A list of prompts
gets one choice each; streamed, the prompts' completions come one after another. Fields:
openai_fields.COMPLETIONS."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import grpc
from pydantic import Field
from starlette.concurrency import iterate_in_threadpool

from raincheck_client._gen import chat_pb2

from ..common.events import read
from ..common.grpc_util import ServiceError
from . import openai_fields
from .call import HttpCall
from .errors import HttpError
from .logprobs import completion_logprobs
from .openai_api import StreamOptions, include_usage
from .openai_fields import RaincheckExtras
from .response_format import grammar_of
from .sampling_fields import sampling_options, stop_strings
from .sse import EventStream
from .stops import StopMatcher

if TYPE_CHECKING:
    from ..frontend.servicer import ChatServicer

MAX_PROMPTS = 64          # prompts in one request (each is a completion of its own)


class CompletionRequest(RaincheckExtras):
    """Every field of OpenAI's completions request (openai_fields.COMPLETIONS) and the declared extras."""
    model: str
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    user: str | None = None
    best_of: Any = None
    suffix: Any = None


def requests_of(r: CompletionRequest) -> list[chat_pb2.CompleteRequest]:
    """One CompleteRequest per prompt (400 for a refused field, too many prompts, or echo with stream)."""
    openai_fields.check(r, openai_fields.COMPLETIONS, openai_fields.CHAT_ONLY)
    single = isinstance(r.prompt, str) or isinstance(r.prompt[0], int)
    prompts: list[str | list[int]] = [r.prompt] if single else list(r.prompt)
    if len(prompts) > MAX_PROMPTS:
        raise HttpError.invalid(f"{len(prompts)} prompts in one request; the limit is {MAX_PROMPTS}", param="prompt")
    asked = r.logprobs is not None
    sampling = sampling_options(r, r.max_tokens, asked, r.logprobs or 0)
    sampling.grammar = grammar_of(r) or ""
    if r.max_tokens == 0 and not r.echo:
        raise HttpError.invalid("max_tokens 0 asks for nothing without echo", param="max_tokens")
    out = []
    for p in prompts:
        request = chat_pb2.CompleteRequest(model=r.model, sampling=sampling, echo=r.echo,
                                           prompt_logprobs=r.logprobs if r.echo and asked else None)
        if isinstance(p, str):
            request.text = p
        else:
            request.token_ids.extend(p)
        out.append(request)
    return out


@dataclass
class Completion:
    """One prompt's completion as it streams: `pieces()` yields (text, logprobs) to show; then `finish_reason`,
    `usage` are set. `close()` ends the call (and the worker's completion)."""
    index: int
    call: HttpCall
    events: Iterator[chat_pb2.ChatEvent]
    stops: StopMatcher
    logprobs: bool
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    scored: list = field(default_factory=list)     # (TokenDelta or None, alternatives, text) per shown token

    def pieces(self) -> Iterator[tuple[str, dict | None]]:
        """Errors after the start raise ServiceError."""
        at = 0
        for part in read(self.events):
            if isinstance(part, chat_pb2.PromptTokens):
                yield self._show(part.text, [(t if i else None, t.top_logprobs, t.token)
                                             for i, t in enumerate(part.tokens)], at)
                at = len(self.text)
            elif isinstance(part, chat_pb2.TokenDelta) and self.stops.matched is None:
                self.completion_tokens += 1
                shown = self.stops.feed(part.text)
                if self.stops.matched is not None:
                    self.call.end()       # the rest of the answer is not wanted
                yield self._show(shown, [(part, part.top_logprobs, part.token)], at)
                at = len(self.text)
            elif isinstance(part, chat_pb2.TurnMetrics):
                self.prompt_tokens = part.prompt_tokens
            elif isinstance(part, chat_pb2.TurnFinal):
                if self.stops.matched is None:
                    yield self._show(self.stops.flush(), [], at)
                self.finish_reason = "stop" if self.stops.matched is not None else part.finish_reason
                return
        if self.stops.matched is None:
            raise ServiceError(grpc.StatusCode.INTERNAL, "the completion's stream ended without its final event")
        self.finish_reason = "stop"         # the call was ended at the stop string

    def _show(self, text: str, tokens: list, at: int) -> tuple[str, dict | None]:
        self.text += text
        self.scored += tokens
        if not self.logprobs or not tokens:
            return text, None
        return text, completion_logprobs([t for t, _, _ in tokens], [a for _, a, _ in tokens],
                                         [s for _, _, s in tokens], at)

    def run(self) -> None:
        for _ in self.pieces():
            pass

    def choice(self) -> dict:
        lp = None
        if self.logprobs:
            lp = completion_logprobs([t for t, _, _ in self.scored], [a for _, a, _ in self.scored],
                                     [s for _, _, s in self.scored])
        return {"index": self.index, "text": self.text, "finish_reason": self.finish_reason, "logprobs": lp}


def completion_id(request_id: str | None = None) -> str:
    return f"cmpl-{request_id or uuid.uuid4().hex}"


def body(cid: str, model: str, runs: list[Completion]) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [c.choice() for c in runs], "usage": usage(runs)}


def usage(runs: list[Completion]) -> dict:
    prompt = sum(c.prompt_tokens for c in runs)
    completion = sum(c.completion_tokens for c in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk(cid: str, model: str, created: int, choices: list[dict], **extra: Any) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            **extra}


async def respond(r: CompletionRequest, call: Callable[[], HttpCall], servicer: ChatServicer,
                  blocking: Callable[..., Awaitable]) -> dict[str, Any] | EventStream:
    """Start every prompt's completion (each on a call of its own, `call()`: errors are the response's
    status), then answer them whole or stream them."""
    wanted = requests_of(r)
    stop = stop_strings(r.stop)
    runs: list[Completion] = []
    try:
        for i, one in enumerate(wanted):
            c = call()
            runs.append(Completion(i, c, await blocking(servicer.Complete, one, c),
                                   StopMatcher(stop, keep=r.include_stop_str_in_output), r.logprobs is not None))
    except BaseException:
        _end(runs)
        raise
    cid = completion_id(r.request_id)
    if not r.stream:
        try:
            async with anyio.create_task_group() as group:
                for run in runs:
                    group.start_soon(blocking, run.run)
        finally:
            _end(runs)
        return body(cid, r.model, runs)
    return EventStream(_chunks(cid, r.model, runs, include_usage(r)), lambda: _end(runs))


def _end(runs: list[Completion]) -> None:
    for run in runs:
        run.call.end()


async def _chunks(cid: str, model: str, runs: list[Completion], with_usage: bool) -> AsyncIterator[dict]:
    """The prompts' completions one after another, as `text_completion` chunks, then usage."""
    created = int(time.time())
    for run in runs:
        async for text, logprobs in iterate_in_threadpool(run.pieces()):
            if text or logprobs:
                choice = {"index": run.index, "text": text, "finish_reason": None, "logprobs": logprobs}
                yield chunk(cid, model, created, [choice])
        done = {"index": run.index, "text": "", "finish_reason": run.finish_reason, "logprobs": None}
        yield chunk(cid, model, created, [done])
    if with_usage:
        yield chunk(cid, model, created, [], usage=usage(runs))
