"""OpenAI's chat completions: the request schema Raincheck accepts, and the response and chunk bodies.

Accepted: `messages` with text and `image_url` parts; `stream` (+ `stream_options.include_usage`);
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n = 1`; Raincheck's
knobs as extra fields (`policy`, `selector`, `retention`, `chunk_size`, `guard`, `tpot_slo`, `recovery_mode`, plus
`top_k`, `ignore_eos`). Omitted sampling fields take the server's defaults (greedy), not OpenAI's.
Features a session cannot honour (tools, logprobs, penalties, structured output, n > 1) are refused with
400 rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raincheck_client._gen import chat_pb2

from .chat import Done, TurnSpec
from .conversation import RoleMessage, group_turns
from .errors import HttpError
from .images import ImageLoader


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")   # OpenAI's bookkeeping fields (user, metadata, store, ...)
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    # refused unless neutral
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # Raincheck's own (extra_body in the openai client)
    top_k: int | None = None
    ignore_eos: bool = False
    policy: str | None = None
    selector: str | None = None
    retention: float | None = None
    chunk_size: int | None = None
    guard: int | None = None
    tpot_slo: float | None = None
    deterministic: bool | None = None
    recovery_mode: str | None = None


def _refuse_unsupported(r: ChatCompletionRequest) -> None:
    if r.n not in (None, 1):
        raise HttpError.invalid("n must be 1: a session turn has one answer", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(r, name):
            raise HttpError.invalid(f"{name} is not supported", param=name)
    if r.logprobs or r.top_logprobs:
        raise HttpError.invalid("logprobs are not supported", param="logprobs")
    if r.logit_bias:
        raise HttpError.invalid("logit_bias is not supported", param="logit_bias")
    if r.tools or r.functions:
        raise HttpError.invalid("tools and function calling are not supported", param="tools")
    if r.response_format and r.response_format.get("type") != "text":
        raise HttpError.invalid("only response_format {'type': 'text'} is supported", param="response_format")


async def to_spec(r: ChatCompletionRequest, images: ImageLoader) -> TurnSpec:
    _refuse_unsupported(r)
    messages = [await _role_message(m, i, images) for i, m in enumerate(r.messages)]
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    sampling = chat_pb2.SamplingOptions(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed,
                                        max_new_tokens=max_tokens, ignore_eos=r.ignore_eos)
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    return TurnSpec(r.model, group_turns(messages), sampling, deferral_of(r), r.recovery_mode, stop)


def deferral_of(r: BaseModel) -> chat_pb2.DeferralSettings | None:
    """The request's deferral knobs (None when it sets none: the session's settings apply)."""
    knobs = {k: getattr(r, k) for k in ("policy", "selector", "retention", "chunk_size", "guard", "tpot_slo",
                                       "deterministic")}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    return chat_pb2.DeferralSettings(**knobs) if knobs else None


async def _role_message(m: Message, i: int, images: ImageLoader) -> RoleMessage:
    where = f"messages[{i}]"
    if m.role in ("tool", "function") or m.tool_calls:
        raise HttpError.invalid(f"{where}: tool messages and tool calls are not supported", param=where)
    if m.content is None:
        raise HttpError.invalid(f"{where}: content is required", param=where)
    if isinstance(m.content, str):
        return RoleMessage(m.role, m.content)
    texts, loaded = [], []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None and m.role != "assistant":
            loaded.append(await images.load(part.image_url.url, f"{where}.content[{j}]"))
        else:
            raise HttpError.invalid(f"{where}.content[{j}]: a {m.role} message's parts are text"
                                    + ("" if m.role == "assistant" else " or image_url")
                                    + f" (got {part.type!r})", param=f"{where}.content[{j}]")
    return RoleMessage(m.role, "\n".join(texts), tuple(loaded))


# -- responses ------------------------------------------------------------------------------------------

def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage_body(done: Done) -> dict:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def completion_body(cid: str, model: str, done: Done) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                         "finish_reason": done.finish_reason, "logprobs": None}],
            "usage": usage_body(done), "raincheck": done.details()}


def chunk_body(cid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               **extra: Any) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                          "logprobs": None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}


def models_body(names: list[str]) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "raincheck"}
                                       for n in names]}
