"""A Responses API request: its model (`ResponsesRequest`, every field of OpenAI's and the declared extras) and its
conversion into the chat it stands for, the previous response's conversation and the input's items as chat
messages (`conversation`) and the request as a chat completion request (`chat_request`)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
from pydantic import Field as PydanticField

from ..common.store import digest
from . import openai_fields
from .errors import HttpError
from .images import ImageLoader
from .openai_api import ChatCompletionRequest
from .openai_fields import EXTRAS, RaincheckExtras
from .response_store import StoredResponse

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


def new_id(prefix: str) -> str:
    """A fresh id for a response or an item: `prefix_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    """A chat tool call as a `function_call` item (of the input, or of a response's output)."""
    fn = call["function"]
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


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
        conv.items.append({"id": item.get("id") or new_id("msg"), "type": "message", "role": role, "content": parts,
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
        conv.items.append(call_item(call, item.get("id")))
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise HttpError.invalid(f"{where}: a function_call_output item has the call_id of its call", param=where)
        content, parts = await _content(conv, output, "tool", f"{where}.output", loader)
        conv.new.append({"role": "tool", "tool_call_id": call_id, "content": content})
        conv.items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output", "call_id": call_id,
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
    parts = [{"type": "image_url", "image_url": {"url": data_url(images[p["image_url"]["url"]])}}
             if p.get("type") == "image_url" else p for p in content]
    return {**message, "content": parts}


def data_url(data: bytes) -> str:
    """An image's bytes as a data URL."""
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
