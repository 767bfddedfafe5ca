"""OpenAI's chat completions: the request schema Raincheck accepts, and the response and chunk bodies.

What each OpenAI field does, and the extra fields accepted, is openai_fields.py's: every field is
honoured, bookkeeping, or refused with a 400, never ignored. Omitted sampling fields take the server's
defaults (greedy), not OpenAI's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raincheck_client._gen import chat_pb2

from . import openai_fields
from .conversation import RoleMessage, group_turns
from .errors import HttpError
from .images import ImageLoader
from .logprobs import chat_logprobs
from .openai_fields import RaincheckExtras, deferral_of
from .response_format import structured_of
from .sampling_fields import render_options, sampling_options, stop_strings
from .session_matching import Done, TurnSpec


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


class ChatCompletionRequest(RaincheckExtras):
    """Every field of OpenAI's chat request (openai_fields.CHAT says what each does) and the declared
    extras; any other field is a 400."""
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
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    response_format: Any = None
    # refused unless neutral (openai_fields.CHAT says why)
    service_tier: Any = None
    store: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None


async def to_spec(r: ChatCompletionRequest, images: ImageLoader) -> TurnSpec:
    openai_fields.check(r, openai_fields.CHAT)
    messages = [await _role_message(m, i, images) for i, m in enumerate(r.messages)]
    sampling = sampling_options(r, max_tokens(r), bool(r.logprobs), r.top_logprobs or 0)
    structured = structured_of(r)
    sampling.grammar = structured.grammar() if structured else ""
    if r.n is not None:
        sampling.n = r.n
    return TurnSpec(r.model, group_turns(messages), sampling, deferral_of(r), r.recovery_mode, stop_strings(r.stop),
                    r.include_stop_str_in_output, render_options(r), structured.field if structured else None)


def max_tokens(r: ChatCompletionRequest) -> int | None:
    """The answer's length limit: max_completion_tokens, else max_tokens (None: the server's default)."""
    return r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens


def include_usage(r: BaseModel) -> bool:
    """A streamed answer ends with a usage chunk (stream_options.include_usage)."""
    return r.stream_options is not None and r.stream_options.include_usage


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

def completion_id(request_id: str | None = None) -> str:
    """A chat completion's id: vLLM's `request_id` when the request gives one."""
    return f"chatcmpl-{request_id or uuid.uuid4().hex}"


def usage_body(dones: Sequence[Done]) -> dict:
    """The usage of a turn's answers (by choice): the prompt counted once, every answer's tokens."""
    u = dones[0].usage
    completion = sum(d.usage.completion_tokens for d in dones)
    accepted = sum(d.metrics.drafts_accepted for d in dones)
    rejected = sum(d.metrics.drafts_proposed for d in dones) - accepted
    # speculative decoding's drafts, in the fields OpenAI reports predicted outputs' by
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def completion_body(cid: str, model: str, dones: Sequence[Done], logprobs: bool = False) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": d.choice, "message": {"role": "assistant", "content": d.text},
                         "finish_reason": d.finish_reason,
                         "logprobs": chat_logprobs(d.logprobs) if logprobs else None} for d in dones],
            "usage": usage_body(dones), "raincheck": dones[0].details()}


def chunk_body(cid: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               logprobs: Sequence[chat_pb2.TokenDelta] = (), choice: int = 0, **extra: Any) -> dict:
    choices = [] if delta is None else [{"index": choice, "delta": delta, "finish_reason": finish_reason,
                                          "logprobs": chat_logprobs(logprobs) if logprobs else None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}


def model_body(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "raincheck"}


def models_body(models: dict[str, int]) -> dict:
    """`/v1/models`: each served model with when it was first loaded (`created`)."""
    return {"object": "list", "data": [model_body(name, created) for name, created in models.items()]}
