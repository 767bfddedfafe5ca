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
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from pydantic import Field as PydanticField
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from ..common.grpc_util import ServiceError
from ..common.store import digest
from . import openai_fields, tool_chat, tools
from .call import HttpCall
from .completions import Completion, usage
from .errors import HttpError
from .images import ImageLoader
from .logprobs import chat_logprobs
from .openai_api import ChatCompletionRequest, to_spec
from .openai_fields import EXTRAS, RaincheckExtras
from .response_store import ResponseStore, StoredResponse
from .session_matching import ChatBackend, Delta, Done, Turn
from .sse import EventStream
from .stops import StopMatcher

IMAGE_REF = "sha256:"                      # an image of a stored conversation, by its bytes' sha256
LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "assistant", "system", "developer")


# the fields RESPONSES refuses: modelled, so that a neutral value passes and another is a 400 naming it
_Refused: type[pydantic.BaseModel] = pydantic.create_model("_Refused", **{
    name: (Any, None) for name, f in openai_fields.RESPONSES.items() if f.status == openai_fields.REFUSED})


class ResponsesRequest(RaincheckExtras, _Refused):
    """Every field of OpenAI's responses request (openai_fields.RESPONSES says what each does) and the declared
    extras; any other field is a 400."""
    model: str
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = PydanticField(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request as a chat --------------------------------------------------------------------------------------

@dataclass
class Conversation:
    """A response's conversation, chat-shaped, its images by sha256 (`IMAGE_REF`) with their bytes in `images`."""
    history: list[dict]                    # the previous response's conversation (without its instructions)
    new: list[dict]                        # this request's input, as chat messages
    items: list[dict]                      # this request's input, as response items
    images: dict[str, bytes] = field(default_factory=dict)

    def chat_messages(self, instructions: str | None) -> list[dict]:
        """The chat to answer: the instructions, the history and the input, images as data URLs."""
        system = [{"role": "system", "content": instructions}] if instructions else []
        return [_with_data_urls(m, self.images) for m in [*system, *self.history, *self.new]]


async def conversation(r: ResponsesRequest, previous: StoredResponse | None, loader: ImageLoader,
                       blob: Callable[[str], Awaitable[bytes | None]]) -> Conversation:
    """The request's input after the previous response's conversation (400 for what cannot be an input)."""
    if r.input is None and previous is None:
        raise HttpError(400, "input is required (or previous_response_id with input)", param="input",
                        code="missing_required_parameter")
    conv = Conversation(list(previous.messages) if previous is not None else [], [], [])
    for m in conv.history:
        for ref in _image_refs(m):
            data = await blob(ref.removeprefix(IMAGE_REF))
            if data is None:
                raise HttpError(404, f"previous_response_id {r.previous_response_id!r}: an image of its conversation "
                                "has expired from the store; send the conversation as input instead",
                                param="previous_response_id", code="previous_response_expired")
            conv.images[ref] = data
    raw = [{"role": "user", "content": r.input}] if isinstance(r.input, str) else list(r.input or [])
    for i, item in enumerate(raw):
        await _add_item(conv, item, f"input[{i}]", loader)
    if not conv.new:
        raise HttpError.invalid("input has no items", param="input")
    return conv


async def _add_item(conv: Conversation, item: Any, where: str, loader: ImageLoader) -> None:
    if not isinstance(item, dict):
        raise HttpError.invalid(f"{where} is an object (a message, function_call or function_call_output item)",
                                param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise HttpError.invalid(f"{where}.role is one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
        content, parts = await _content(conv, item.get("content"), role, where, loader)
        conv.new.append({"role": role, "content": content})
        conv.items.append({"id": item.get("id") or _id("msg"), "type": "message", "role": role, "content": parts,
                           "status": "completed"})
    elif kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(arguments, str):
            raise HttpError.invalid(f"{where}: a function_call item has call_id, name and arguments (a JSON string)",
                                    param=where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = conv.new[-1] if conv.new else None
        if last is not None and last["role"] == "assistant":     # the calls of one answer: one assistant message
            last.setdefault("tool_calls", []).append(call)
        else:
            conv.new.append({"role": "assistant", "content": None, "tool_calls": [call]})
        conv.items.append(_call_item(call, item.get("id")))
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise HttpError.invalid(f"{where}: a function_call_output item has the call_id of its call", param=where)
        content, parts = await _content(conv, output, "tool", f"{where}.output", loader)
        conv.new.append({"role": "tool", "tool_call_id": call_id, "content": content})
        conv.items.append({"id": item.get("id") or _id("fco"), "type": "function_call_output", "call_id": call_id,
                           "output": output if isinstance(output, str) else parts, "status": "completed"})
    else:
        raise HttpError.unsupported(f"{where}.type {kind!r} is not supported: input items are messages, function_call "
                                    "and function_call_output items (previous_response_id carries the rest)",
                                    param=f"{where}.type")


async def _content(conv: Conversation, content: Any, role: str, where: str, loader: ImageLoader
                   ) -> tuple[str | list[dict], list[dict]]:
    """A message's content as the chat's (a string, or text and image_url parts, images by reference) and as
    the input item's parts."""
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return content, [{"type": text_type, "text": content}]
    if not isinstance(content, list):
        raise HttpError.invalid(f"{where} is a string or a list of parts", param=where)
    chat, parts = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]" if where.endswith("output") else f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            chat.append({"type": "text", "text": part["text"]})
            parts.append({"type": text_type, "text": part["text"]})
        elif kind == "input_image" and role in ("user", "tool"):
            if part.get("file_id") or not isinstance(part.get("image_url"), str):
                raise HttpError.unsupported(f"{at}: an input_image is an image_url (a data URL); files are not "
                                            "stored here", param=at)
            data = await loader.load(part["image_url"], at)
            ref = IMAGE_REF + digest(data)
            conv.images[ref] = data
            chat.append({"type": "image_url", "image_url": {"url": ref}})
            parts.append({"type": "input_image", "image_url": ref, "detail": part.get("detail") or "auto"})
        else:
            allowed = "input_text" + (" or input_image" if role in ("user", "tool") else "")
            raise HttpError.invalid(f"{at}: a {role} message's parts are {allowed} (got {kind!r})", param=at)
    if not any(p["type"] == "image_url" for p in chat):     # text only: one string, as templates expect
        return "".join(p["text"] for p in chat), parts
    return chat, parts


def _image_refs(message: dict) -> list[str]:
    content = message.get("content")
    return [p["image_url"]["url"] for p in content if p.get("type") == "image_url"] if isinstance(content, list) else []


def _with_data_urls(message: dict, images: dict[str, bytes]) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{"type": "image_url", "image_url": {"url": _data_url(images[p["image_url"]["url"]])}}
             if p.get("type") == "image_url" else p for p in content]
    return {**message, "content": parts}


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_request(r: ResponsesRequest, conv: Conversation) -> ChatCompletionRequest:
    """The chat completion the request stands for (400 for what it cannot carry)."""
    include = r.include or []
    for name in include:
        if name != LOGPROBS:
            raise HttpError.unsupported(f"include {name!r} is not supported: only {LOGPROBS!r} is", param="include")
    logprobs = LOGPROBS in include or r.top_logprobs is not None
    fields = {name: getattr(r, name) for name in EXTRAS if name in r.model_fields_set}
    fields |= {"model": r.model, "messages": conv.chat_messages(r.instructions), "stream": r.stream,
               "max_completion_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
               "logprobs": logprobs or None, "top_logprobs": r.top_logprobs, "user": r.user,
               "safety_identifier": r.safety_identifier, "prompt_cache_key": r.prompt_cache_key,
               "tools": [_tool(t, i) for i, t in enumerate(r.tools)] if r.tools else None,
               "tool_choice": _tool_choice(r.tool_choice), "parallel_tool_calls": r.parallel_tool_calls,
               "response_format": _response_format(r.text)}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as e:
        raise HttpError.invalid(f"invalid request: {e.errors()[0]['msg']}") from None


def _tool(t: Any, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise HttpError.unsupported(f"tools[{i}]: only function tools are supported (this server runs no built-in "
                                    f"tools); got {kind!r}", param=f"tools[{i}]")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HttpError.unsupported(f"tool_choice is none, auto, required or {{'type': 'function', 'name': ...}}; got "
                                f"{choice!r}", param="tool_choice")


def _response_format(text: dict | None) -> dict | None:
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise HttpError.unsupported("text.verbosity is not supported: the served models have no verbosity control",
                                    param="text.verbosity")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt                 # json_object, or what response_format refuses with its own 400


# -- the output ---------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What the answer came to: its text (None when it is only calls), calls, why it ended, usage, details."""
    text: str | None
    calls: list[dict]
    finish_reason: str
    usage: dict
    logprobs: list[dict] = field(default_factory=list)
    details: dict | None = None            # Raincheck's (session, match, timings), for the `raincheck` field


def _usage(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI's usage: `cached_tokens` what the session (or the prefix cache) held, `cache_write_tokens` what
    this request prefilled into it."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                             "cache_write_tokens": prompt - cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _session_outcome(done: Done) -> Outcome:
    u = done.usage
    return Outcome(done.text, [], done.finish_reason, _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                   _entries(done.logprobs), done.details())


def _tool_outcome(run: Completion, chat: tools.ToolChat) -> Outcome:
    content, calls = tools.split_calls(run.text, chat.parallel)
    u = usage([run])
    return Outcome(content, calls, run.finish_reason or "stop", _usage(u["prompt_tokens"], u["completion_tokens"], 0))


def _entries(tokens: Sequence) -> list[dict]:
    return chat_logprobs(tokens)["content"] if tokens else []


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict]) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    fn = call["function"]
    return {"id": item_id or _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def _status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" and not outcome.calls else "completed"


def _output(outcome: Outcome, message_id: str) -> list[dict]:
    out = []
    if outcome.text or not outcome.calls:
        out.append(_message_item(message_id, outcome.text or "", _status(outcome), outcome.logprobs))
    return out + [_call_item(c) for c in outcome.calls]


def response_body(rid: str, r: ResponsesRequest, created: int, status: str, output: list[dict],
                  outcome: Outcome | None = None, error: dict | None = None) -> dict:
    body = {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": r.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": r.store is not False, "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto", "tools": r.tools or [],
            "top_logprobs": r.top_logprobs, "truncation": "disabled", "user": r.user, "metadata": r.metadata or {},
            "background": False, "service_tier": "default",
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "usage": outcome.usage if outcome is not None else None}
    if outcome is not None and outcome.details is not None:
        body["raincheck"] = outcome.details
    return body


def _answer_messages(outcome: Outcome) -> list[dict]:
    """The response's output as the chat messages that continue its conversation."""
    message = {"role": "assistant", "content": outcome.text if outcome.calls else outcome.text or ""}
    if outcome.calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in outcome.calls]
    return [message]


# -- streamed -------------------------------------------------------------------------------------------------------

class _Events:
    """Events in order, each with its sequence number."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return event


async def _stream(r: ResponsesRequest, rid: str, created: int, pieces: AsyncIterator[tuple[str, list[dict]]],
                  outcome: Callable[[], Outcome], save: Callable[[dict, Outcome], None]) -> AsyncIterator[dict]:
    ev = _Events()
    shell = response_body(rid, r, created, "in_progress", [])
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    message_id, shown, opened = _id("msg"), [], False

    def open_message() -> list[dict]:
        item = _message_item(message_id, "", "in_progress", [])
        item["content"] = []
        return [ev("response.output_item.added", output_index=0, item=item),
                ev("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                   part=_text_part("", []))]

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
    output = _output(result, message_id)
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
    body = response_body(rid, r, created, _status(result), output, result)
    await run_in_threadpool(save, body, result)      # stored before the client hears it is done
    yield ev(f"response.{body['status']}", response=body)


async def _session_pieces(turn: Turn, holder: list[Done]) -> AsyncIterator[tuple[str, list[dict]]]:
    async for event in iterate_in_threadpool(turn.run()):
        if isinstance(event, Delta):
            yield event.text, _entries(event.logprobs)
        else:
            holder.append(event)


async def _tool_pieces(run: Completion) -> AsyncIterator[tuple[str, list[dict]]]:
    """The answer's text until a call may begin (the rest is settled at its end)."""
    before = StopMatcher([tools.OPEN], keep=True)
    async for text, _ in iterate_in_threadpool(run.pieces()):
        if before.matched is None and (shown := before.feed(text).removesuffix(tools.OPEN)):
            yield shown, []


# -- routes -----------------------------------------------------------------------------------------------------------

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
                                                                   *_answer_messages(outcome)],
                                         r.instructions, conv.items))
        return save

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        try:
            return await create(body, request)
        except HttpError as e:
            raise _named_as_responses(e) from None

    async def create(body: ResponsesRequest, request: Request):
        owner = await blocking(backend.owner, HttpCall.of(request))
        openai_fields.check(body, openai_fields.RESPONSES)
        previous = None
        if body.previous_response_id is not None:
            previous = await owned(request, body.previous_response_id, "previous_response_id")
        conv = await conversation(body, previous, images, lambda digest: blocking(store.blob, digest))
        chat = chat_request(body, conv)
        rid, created, save = _id("resp"), int(time.time()), saver(body, owner, conv)
        if tools.uses_tools(chat):
            found, run = await tool_chat.start(chat, HttpCall.of(request), backend.servicer, blocking, images)
            if body.stream:
                return EventStream(_stream(body, rid, created, _tool_pieces(run), lambda: _tool_outcome(run, found),
                                           save), run.call.end, typed=True)
            try:
                await blocking(run.run)
            finally:
                run.call.end()
            outcome = _tool_outcome(run, found)
        else:
            turn = await start(request, lambda: to_spec(chat, images))
            if body.stream:
                dones: list[Done] = []
                return EventStream(_stream(body, rid, created, _session_pieces(turn, dones),
                                           lambda: _session_outcome(dones[0]), save), turn.close, typed=True)
            outcome = _session_outcome((await finish(turn))[0])
        reply = response_body(rid, body, created, _status(outcome), _output(outcome, _id("msg")), outcome)
        await blocking(save, reply, outcome)
        return reply

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request, stream: bool = False):
        if stream:
            raise HttpError.unsupported("stream is not supported here: a stored response is returned whole",
                                        param="stream")
        return (await owned(request, response_id)).body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        await owned(request, response_id)
        await blocking(responses.delete, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        await owned(request, response_id)
        raise HttpError(400, "only background responses can be cancelled, and this server runs none",
                        code="unsupported_parameter")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, order: str = "desc", limit: int = 20,
                          after: str | None = None):
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
        return {**p, "image_url": _data_url(data) if data is not None else None}

    parts = item.get("content") if item["type"] == "message" else item.get("output")
    if not isinstance(parts, list):
        return item
    key = "content" if item["type"] == "message" else "output"
    return {**item, key: [part(p) for p in parts]}
