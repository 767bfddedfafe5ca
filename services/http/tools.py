"""Tool calling on chat completions: `tools`, `tool_choice`, assistant `tool_calls` and `tool` result
messages, through the checkpoint's chat template and a parser for the Qwen family's call format
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`).

A chat with tools runs as a stateless completion of the whole rendered chat (the frontend's Complete RPC;
no session: a session's turns are user messages, and the template renders tools and tool results around
them). Its user messages may hold images (a screenshot next to the tools, say): each becomes a
`{"type": "image"}` part, its bytes sent beside the chat, and the worker renders them where the template
puts them (a template that renders no images refuses them).

`tool_choice`: `none` renders no tools; `auto` renders them and parses any calls in the answer; `required`
and a named function also hold the answer to a call's grammar (llguidance: the tag, then JSON
of one of the functions' names with arguments its parameter schema accepts), so the call always parses.
A structured output (response_format.py) holds the content: with `none` the whole answer, with `auto` the
answer is that content or tool calls (a grammar of both); a forced call has no content, so its grammar alone
holds the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from . import openai_fields
from .errors import HttpError
from .images import ImageLoader
from .response_format import Structured, structured_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
# request fields a stateless tool chat cannot honour
NOT_WITH_TOOLS = ("logprobs", "top_logprobs", *openai_fields.SESSION_KNOBS)


@dataclass(frozen=True)
class ToolChat:
    messages_json: str
    tools_json: str               # "" when no tool is offered (tool_choice none)
    grammar: str | None           # the forced call's grammar (required / a named function), or the structured
                                  # output's (none), or that of either (auto)
    parallel: bool                # more than one call may be returned
    continue_final: bool = False  # the answer continues the last (assistant) message
    images: tuple[bytes, ...] = ()   # the messages' {"type": "image"} parts, in order
    echo: str = ""                # vLLM's echo: what goes in front of the answer


def uses_tools(r: Any) -> bool:
    """The request runs as a stateless chat: tools in any form, a final assistant message to continue, or a
    chat rendered without the assistant prompt."""
    return (bool(r.tools) or r.tool_choice is not None or r.parallel_tool_calls is not None
            or r.continue_final_message or not r.add_generation_prompt
            or any(m.role == "tool" or m.tool_calls for m in r.messages))


async def tool_chat(r: Any, loader: ImageLoader) -> ToolChat:
    """The request as a chat to render, its images loaded (400 for what a tool chat cannot do)."""
    openai_fields.check(r, openai_fields.CHAT)
    for name in NOT_WITH_TOOLS:
        if getattr(r, name) not in (None, False, {"type": "text"}):
            raise HttpError.invalid(f"{name} cannot be combined with tools, tool messages or continue_final_message (a "
                                    "stateless text chat)", param=name)
    if r.n not in (None, 1):
        raise HttpError.invalid("n > 1 cannot be combined with tools, tool messages or continue_final_message (a "
                                "stateless chat runs one answer)", param="n")
    tools = [_tool(t, i) for i, t in enumerate(r.tools or [])]
    choice = r.tool_choice if r.tool_choice is not None else "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    if choice == "none":
        offered, forced = [], []
    elif choice == "auto":
        offered, forced = tools, []
    elif choice == "required":
        offered, forced = tools, tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            choice["function"].get("name") in names:
        offered, forced = tools, [tools[names.index(choice["function"]["name"])]]
    else:
        raise HttpError.invalid(f"tool_choice is none, auto, required or one of the tools "
                                f"({{'type': 'function', 'function': {{'name': ...}}}}); got {choice!r}",
                                param="tool_choice")
    if choice != "none" and not tools:
        raise HttpError.invalid("tool_choice needs tools", param="tool_choice")
    if r.parallel_tool_calls is not None and not tools:
        raise HttpError.invalid("parallel_tool_calls needs tools", param="parallel_tool_calls")
    images: list[bytes] = []
    messages = [await _message(m, i, loader, images) for i, m in enumerate(r.messages)]
    parallel = r.parallel_tool_calls is not False
    structured = structured_of(r)
    if forced:
        grammar = call_grammar(forced)
    elif structured is None:
        grammar = None
    elif offered:
        grammar = answer_or_calls_grammar(structured, offered, parallel)
    else:
        grammar = structured.grammar()
    return ToolChat(json.dumps(messages), json.dumps(offered) if offered else "", grammar, parallel,
                    r.continue_final_message, tuple(images), _echo(r, messages))


def _echo(r: Any, messages: list[dict]) -> str:
    """vLLM's chat `echo`: the final message's text goes in front of the answer where it has the answer's role
    (assistant, or, with add_generation_prompt false, whatever the final message's is)."""
    last = messages[-1]
    role = "assistant" if r.add_generation_prompt and not r.continue_final_message else last["role"]
    if not r.echo or last["role"] != role:
        return ""
    content = last["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _tool(t: Any, i: int) -> dict:
    fn = t.get("function") if isinstance(t, dict) else None
    if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str) and fn["name"]):
        raise HttpError.invalid(f"tools[{i}] is {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                "...}}}}", param=f"tools[{i}]")
    if not isinstance(fn.get("parameters", {}), dict):
        raise HttpError.invalid(f"tools[{i}].function.parameters is a JSON schema object", param=f"tools[{i}]")
    return {"type": "function", "function": fn}


async def _message(m: Any, i: int, loader: ImageLoader, images: list[bytes]) -> dict:
    """One message as the template reads it: text as a string; with images, typed parts in their order."""
    content = m.content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if p.type == "text" and p.text is not None:
                parts.append({"type": "text", "text": p.text})
            elif p.type == "image_url" and p.image_url is not None and m.role in ("user", "tool"):
                images.append(await loader.load(p.image_url.url, where))     # a screenshot a tool returned, too
                parts.append({"type": "image"})
            else:
                raise HttpError.invalid(f"{where}: a {m.role} message's parts are text"
                                        + (" or image_url" if m.role in ("user", "tool") else "")
                                        + f" (got {p.type!r})", param=where)
        has_images = any(p["type"] == "image" for p in parts)
        content = parts if has_images else "\n".join(p["text"] for p in parts)
    out = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    return out


def _call_rules(tools: list[dict]) -> str:
    """Lark rules: `call`, one call of one of `tools` in the tagged format the parser reads."""
    schemas = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}),
              "x-guidance": {"whitespace_flexible": False}}
    return f'call: "{OPEN}\\n" call_json "\\n{CLOSE}"\ncall_json: %json {json.dumps(schema)}'


def call_grammar(tools: list[dict]) -> str:
    """The grammar of exactly one call of one of `tools`."""
    return llguidance.LLMatcher.grammar_from_lark("start: call\n" + _call_rules(tools))


def answer_or_calls_grammar(structured: Structured, tools: list[dict], parallel: bool) -> str:
    """The grammar of an answer that is either the structured output or calls of `tools` (one unless
    `parallel`); 400 naming the structured output's field where it does not compile."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    grammar = llguidance.LLMatcher.grammar_from_lark(
        f"start: answer | {calls}\nanswer: {structured.lark_rule()}\n{_call_rules(tools)}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise HttpError.invalid(f"{structured.field}: invalid grammar beside tool calls: {error.strip()[:1000]}",
                                param=structured.field)
    return grammar


def split_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """The answer's content (None when only calls) and its tool calls as OpenAI writes them. A block that
    does not parse (an answer cut by max_tokens) stays in the content."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if calls and not parallel:
            break
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments)}})
    kept.append(text[last:])
    if not calls:
        return text, calls
    return "".join(kept).strip() or None, calls
