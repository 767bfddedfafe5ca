"""Every field of OpenAI's chat, completions and responses requests, and what Raincheck does with it: each is
honoured, accepted as bookkeeping (it never changes an answer: `user`, `metadata`, ...), or refused with
a 400 when set to anything but its neutral value. Never silently ignored: tests/http/test_openai_fields.py
walks the openai package's request types against these tables, and docs/services.md lists them.

`EXTRAS` is the one place that declares the fields a request may carry beyond OpenAI's (Raincheck's
knobs, the vLLM/SGLang extensions apps and eval harnesses send: sampling, the chat template's variables,
the images' preprocessing, the answer's decoding), and `REFUSED_EXTRAS` the vLLM extensions this server
cannot honour (a 400 naming them when they ask for something); the request models are built on both, and a
field in none of these lists is refused (the request models forbid unknown fields). Of them,
`SESSION_KNOBS` (the deferral settings and a new session's recovery mode) are SGLang's /generate extras too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from raincheck_client._gen import chat_pb2

from .errors import HttpError

HONOURED, BOOKKEEPING, REFUSED = "honoured", "bookkeeping", "refused"


@dataclass(frozen=True)
class Field:
    status: str                        # HONOURED | BOOKKEEPING | REFUSED
    note: str                          # how it is honoured, or why it is refused
    neutral: tuple = (None,)           # values that ask for nothing (a refused field may carry them)


def _refused(note: str, *neutral: Any) -> Field:
    return Field(REFUSED, note, (None, *neutral))


_SHARED = {
    "model": Field(HONOURED, "the served model's name (404 for another)"),
    "stream": Field(HONOURED, "server-sent events"),
    "stream_options": Field(HONOURED, "include_usage: a last chunk with usage; 400 without stream"),
    "max_tokens": Field(HONOURED, "the answer's length limit"),
    "temperature": Field(HONOURED, "0 (the default) is greedy"),
    "top_p": Field(HONOURED, "nucleus sampling"),
    "seed": Field(HONOURED, "reproducible sampling"),
    "stop": Field(HONOURED, "stop strings, cut from the answer"),
    "presence_penalty": Field(HONOURED, "per request, in the batched sampler's row"),
    "frequency_penalty": Field(HONOURED, "per request, in the batched sampler's row"),
    "logit_bias": Field(HONOURED, "token id -> bias in [-100, 100]"),
    "user": Field(BOOKKEEPING, "an end-user id for the operator's logs; never changes an answer"),
}

CHAT: dict[str, Field] = {
    **_SHARED,
    "messages": Field(HONOURED, "system, user (text, image_url), assistant (with tool_calls), tool"),
    "n": Field(HONOURED, "n answers sharing the prompt's prefill (the session continues choice 0); not with tools"),
    "max_completion_tokens": Field(HONOURED, "as max_tokens (wins over it)"),
    "logprobs": Field(HONOURED, "log softmax of the model's logits for each chosen token"),
    "top_logprobs": Field(HONOURED, "0-20 alternatives per token (needs logprobs)"),
    "metadata": Field(BOOKKEEPING, "tags for stored completions; never changes an answer"),
    "safety_identifier": Field(BOOKKEEPING, "an end-user id for abuse reports; never changes an answer"),
    "prompt_cache_key": Field(BOOKKEEPING, "a cache routing hint; sessions are matched by history instead"),
    "service_tier": _refused("one service tier", "auto", "default"),
    "store": _refused("completions are not stored for retrieval", False),
    "response_format": Field(HONOURED, "json_object, json_schema: a grammar mask in the sampler (llguidance); "
                             "with tools too"),
    "tools": Field(HONOURED, "rendered by the checkpoint's chat template; calls parsed into tool_calls"),
    "tool_choice": Field(HONOURED, "none, auto, required or a named function (the last two grammar-forced)"),
    "parallel_tool_calls": Field(HONOURED, "false: at most one call is returned"),
    "functions": _refused("the deprecated form of tools: send tools", []),
    "function_call": _refused("the deprecated form of tool_choice: send tool_choice", "none"),
    "audio": _refused("text output only"),
    "modalities": _refused("text output only", ["text"]),
    "prediction": _refused("no predicted outputs (speculative decoding)"),
    "reasoning_effort": _refused("the served models have no reasoning-effort control"),
    "verbosity": _refused("the served models have no verbosity control"),
    "web_search_options": _refused("no web search"),
    "moderation": _refused("no moderation"),
    "prompt_cache_retention": _refused("sessions are kept by the server's own expiry"),
    "prompt_cache_options": _refused("sessions are kept by the server's own expiry"),
}

COMPLETIONS: dict[str, Field] = {
    **_SHARED,
    "prompt": Field(HONOURED, "a string, token ids, or a list of either (one choice each)"),
    "echo": Field(HONOURED, "the prompt in front of the answer (with its logprobs when asked)"),
    "logprobs": Field(HONOURED, "0-20: each token's logprob and that many alternatives"),
    "n": _refused("one answer per prompt: send n answers through chat completions", 1),
    "best_of": _refused("one answer per request", 1),
    "suffix": _refused("no fill-in-the-middle", ""),
}

RESPONSES: dict[str, Field] = {
    "model": Field(HONOURED, "the served model's name (404 for another)"),
    "input": Field(HONOURED, "a string, or items: messages (input_text, input_image; output_text of earlier "
                   "answers), function_call, function_call_output"),
    "instructions": Field(HONOURED, "a system message in front of the conversation; previous_response_id does not "
                          "carry it over"),
    "previous_response_id": Field(HONOURED, "the conversation so far: continues the session that answered it"),
    "stream": Field(HONOURED, "server-sent events, each named by its type"),
    "stream_options": Field(BOOKKEEPING, "include_obfuscation: no obfuscation is ever added"),
    "max_output_tokens": Field(HONOURED, "the answer's length limit (status incomplete when reached)"),
    "temperature": Field(HONOURED, "0 (the default) is greedy"),
    "top_p": Field(HONOURED, "nucleus sampling"),
    "top_logprobs": Field(HONOURED, "0-20 alternatives per token, in output_text.logprobs"),
    "include": Field(HONOURED, "message.output_text.logprobs (any other is a 400)"),
    "tools": Field(HONOURED, "function tools, rendered by the checkpoint's chat template; calls as function_call "
                   "items"),
    "tool_choice": Field(HONOURED, "none, auto, required or a named function (the last two grammar-forced)"),
    "parallel_tool_calls": Field(HONOURED, "false: at most one call is returned"),
    "text": Field(HONOURED, "format: text, json_object or json_schema, as chat's response_format"),
    "store": Field(HONOURED, "false: not kept (no retrieval, and no previous_response_id can name it)"),
    "max_tool_calls": Field(BOOKKEEPING, "it bounds built-in tool calls, and this server runs none"),
    "metadata": Field(BOOKKEEPING, "tags kept with the response; never change an answer"),
    "user": Field(BOOKKEEPING, "an end-user id for the operator's logs; never changes an answer"),
    "safety_identifier": Field(BOOKKEEPING, "an end-user id for abuse reports; never changes an answer"),
    "prompt_cache_key": Field(BOOKKEEPING, "a cache routing hint; sessions are matched by history instead"),
    "truncation": _refused("a conversation past the context is a 400, never cut", "disabled"),
    "reasoning": _refused("the served models have no reasoning-effort control", {}, {"effort": None},
                          {"effort": None, "summary": None}),
    "background": _refused("responses run while the request waits", False),
    "background_options": _refused("responses run while the request waits"),
    "conversation": _refused("a conversation is continued by previous_response_id"),
    "prompt": _refused("no stored prompt templates"),
    "service_tier": _refused("one service tier", "auto", "default"),
    "context_management": _refused("a conversation is kept whole, never compacted"),
    "access_programs": _refused("no access programs"),
    "image": _refused("text output only"),
    "moderation": _refused("no moderation"),
    "prompt_cache_retention": _refused("sessions are kept by the server's own expiry"),
    "prompt_cache_options": _refused("sessions are kept by the server's own expiry"),
}

# Raincheck's deferral knobs (DeferralSettings, for the request's turn) and a new session's recovery mode:
# name -> (type, default, note).
DEFERRAL: dict[str, tuple[Any, Any, str]] = {
    "policy": (str | None, None, "deferral policy for this request's turn"),
    "selector": (str | None, None, "deferral: which visual tokens go first"),
    "retention": (float | None, None, "deferral: fraction of visual tokens prefilled first"),
    "chunk_size": (int | None, None, "deferral: deferred rows fused per decode step"),
    "guard": (int | None, None, "deferral: decode tokens before the first deferred chunk"),
    "tpot_slo": (float | None, None, "deferral: allowed mean TPOT as a ratio of a plain step"),
    "barrier_timeout_s": (float | None, None, "deferral: longest wait for the previous turn's deferred rows "
                          "(0: never; negative: all)"),
    "deterministic": (bool | None, None, "the same answer for the same request, whatever else the server runs"),
}
SESSION_KNOBS: dict[str, tuple[Any, Any, str]] = {
    **DEFERRAL,
    "recovery_mode": (str | None, None, "a new session's recovery mode"),
}

# Raincheck's knobs and vLLM/SGLang extras (extra_body in the openai client): name -> (type, default, note).
EXTRAS: dict[str, tuple[Any, Any, str]] = {
    "top_k": (int | None, None, "top-k sampling (0, or vLLM's -1: off)"),
    "min_p": (float | None, None, "drop tokens below min_p x the top token's probability"),
    "min_tokens": (int | None, None, "the stop tokens cannot end the answer before this many"),
    "repetition_penalty": (float | None, None, "divides seen tokens' positive logits (1: off)"),
    "stop_token_ids": (list[int] | None, None, "token ids that end the answer"),
    "ignore_eos": (bool, False, "keep going past the model's stop tokens (benchmarks)"),
    **SESSION_KNOBS,
    "continue_final_message": (bool, False, "continue the final assistant message (a stateless chat completion)"),
    # structured outputs under vLLM's names (response_format.py)
    "structured_outputs": (dict | None, None, "one of json, regex, choice, grammar (Lark or GBNF), json_object"),
    "guided_json": (Any, None, "a JSON schema the answer follows"),
    "guided_regex": (str | None, None, "a regex the answer matches"),
    "guided_choice": (list[str] | None, None, "the answer is one of these strings"),
    "guided_grammar": (str | None, None, "a Lark (or GBNF) grammar the answer follows"),
    "add_generation_prompt": (bool, True, "false: the chat is rendered without the assistant prompt (a stateless "
                              "chat completion)"),
    "chat_template_kwargs": (dict[str, Any] | None, None, "variables of the chat template (e.g. enable_thinking: "
                             "false on Qwen3's); a session continues only with the same ones"),
    "mm_processor_kwargs": (dict[str, Any] | None, None, "the images' preprocessing: min_pixels, max_pixels (at "
                            "most the checkpoint's), fps (videos); a session continues only with the same ones"),
    "echo": (bool, False, "chat: the final message in front of the answer where it is the answer's role (a final "
             "assistant message, or any with add_generation_prompt false); completions: the prompt"),
    "skip_special_tokens": (bool, True, "false: the answer keeps the special tokens the model generates (never "
                            "the stop token that ended it)"),
    "spaces_between_special_tokens": (bool, True, "with skip_special_tokens false, passed to the tokenizer's "
                                      "decoding (the served byte-level tokenizers put no spaces either way)"),
    "include_stop_str_in_output": (bool, False, "a matched stop string stays at the end of the answer"),
    "request_id": (str | None, None, "the response's id (chatcmpl-<request_id>, cmpl-<request_id>)"),
}

# vLLM's extensions this server cannot honour: a 400 naming them unless neutral
REFUSED_EXTRAS: dict[str, Field] = {
    "best_of": _refused("one answer per request", 1),
    "use_beam_search": _refused("no beam search", False),
    "length_penalty": _refused("no beam search", 1, 1.0),
    "truncate_prompt_tokens": _refused("prompts are never truncated: a request past the context is a 400"),
    "prompt_logprobs": _refused("prompt logprobs come from /v1/completions (echo with logprobs)"),
    "allowed_token_ids": _refused("no allowed-token list: use logit_bias"),
    "bad_words": _refused("no bad-words list: use logit_bias or stop", []),
    "chat_template": _refused("chats are rendered by the checkpoint's own chat template only"),
    "documents": _refused("the served chat templates take no documents", []),
    "priority": _refused("requests are not prioritized", 0),
    "cache_salt": _refused("the prefix cache is shared by content: a salt cannot isolate a request's pages"),
    "return_tokens_as_token_ids": _refused("logprobs name tokens by their text", False),
}

# extras that only a chat with images or a session can use: a completion (text, no session) refuses them
CHAT_ONLY = (*SESSION_KNOBS, "continue_final_message", "add_generation_prompt", "chat_template_kwargs",
             "mm_processor_kwargs")


def _fields(table: dict[str, tuple[Any, Any, str]]) -> dict[str, tuple[Any, Any]]:
    return {name: (kind, default) for name, (kind, default, _) in table.items()}


RaincheckExtras: type[BaseModel] = create_model("RaincheckExtras", __config__=ConfigDict(extra="forbid"),
                                                **_fields(EXTRAS), **{k: (Any, None) for k in REFUSED_EXTRAS})
# the session knobs as fields of a request model (SGLang's /generate adds them to its own)
SessionKnobs: type[BaseModel] = create_model("SessionKnobs", **_fields(SESSION_KNOBS))


def deferral_of(r: BaseModel) -> chat_pb2.DeferralSettings | None:
    """The request's deferral knobs (None when it sets none: the session's settings apply)."""
    knobs = {k: getattr(r, k) for k in DEFERRAL}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    return chat_pb2.DeferralSettings(**knobs) if knobs else None


def check(request: BaseModel, table: dict[str, Field], refused_extras: tuple[str, ...] = ()) -> None:
    """400 naming the first refused field (of `table`, or of REFUSED_EXTRAS) set to a value that asks for
    something, or extra in `refused_extras` set to anything but its default, or `stream_options` without
    `stream`."""
    for name, field in [*table.items(), *REFUSED_EXTRAS.items()]:
        if field.status == REFUSED and getattr(request, name, None) not in field.neutral:
            raise HttpError.unsupported(f"{name} is not supported: {field.note}", param=name)
    for name in refused_extras:
        default = EXTRAS[name][1]
        if getattr(request, name) not in (None, default, *((False,) if default is None else ())):
            raise HttpError.unsupported(f"{name} is not supported here: a completion is text without a session",
                                        param=name)
    if request.stream_options is not None and not request.stream:
        raise HttpError.invalid("stream_options needs stream: true", param="stream_options")
