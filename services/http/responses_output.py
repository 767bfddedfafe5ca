"""A Responses API answer: what a chat's answer came to (`Outcome`, from a session's turn or a tool chat's run)
and the response it makes: its output items, its body and the chat messages that continue its conversation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import tools
from .completions import Completion, usage
from .logprobs import chat_logprobs
from .responses_request import ResponsesRequest, call_item
from .session_matching import Done


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


def session_outcome(done: Done) -> Outcome:
    u = done.usage
    return Outcome(done.text, [], done.finish_reason, _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                   entries(done.logprobs), done.details())


def tool_outcome(run: Completion, chat: tools.ToolChat) -> Outcome:
    content, calls = tools.split_calls(run.text, chat.parallel)
    u = usage([run])
    return Outcome(content, calls, run.finish_reason or "stop", _usage(u["prompt_tokens"], u["completion_tokens"], 0))


def entries(tokens: Sequence) -> list[dict]:
    return chat_logprobs(tokens)["content"] if tokens else []


def message_item(item_id: str, text: str, status: str, logprobs: list[dict]) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def response_status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" and not outcome.calls else "completed"


def output_items(outcome: Outcome, message_id: str) -> list[dict]:
    out = []
    if outcome.text or not outcome.calls:
        out.append(message_item(message_id, outcome.text or "", response_status(outcome), outcome.logprobs))
    return out + [call_item(c) for c in outcome.calls]


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


def answer_messages(outcome: Outcome) -> list[dict]:
    """The response's output as the chat messages that continue its conversation."""
    message = {"role": "assistant", "content": outcome.text if outcome.calls else outcome.text or ""}
    if outcome.calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in outcome.calls]
    return [message]
