"""What a worker serves outside sessions: completions of raw text, token ids or a rendered chat (OpenAI's
/v1/completions, and chats with tools; an engine session opened for the request and closed after it),
and its tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, InvalidInputError, Prompt, Session, TokenEvent, TurnEnd, TurnMetrics
from raincheck_core.multimodal.chat import ChatFormatter, chatml_template

from .convert import error_event, final_event, metrics_event, to_sampling, token_delta

T = TypeVar("T")


def complete(engine: Engine, request: chat_pb2.CompleteRequest, max_new_tokens: int,
             admit: Callable[[Callable[[], T]], T]) -> Iterator[chat_pb2.ChatEvent]:
    """Check and admit the completion now (typed errors raise here); the returned stream runs it.
    `max_new_tokens`: the worker's default; `admit(action)`: runs an admission, freeing idle sessions'
    caches while it runs out of room (eviction.py)."""
    ids = prompt_ids(engine, request)
    o = request.sampling
    if o.HasField("n") and o.n != 1:
        raise InvalidInputError("Complete runs one answer per prompt: n must be 1 (send n > 1 through Chat)")
    answer = not (o.HasField("max_new_tokens") and o.max_new_tokens == 0)
    sampling = to_sampling(o, max_new_tokens) if answer else None
    limit = engine.max_model_len
    if limit is not None and len(ids) > limit:
        raise InvalidInputError(f"the prompt has {len(ids)} tokens; the context is {limit}")
    prompt = None
    if request.echo:
        prompt = chat_pb2.PromptTokens(tokens=_prompt_tokens(engine, ids, request, admit), text=_decode(engine, ids))
    if not answer:
        return _scored_only(ids, prompt)
    session = admit(engine.open_session)
    try:
        stream = admit(lambda: session.turn(Prompt(list(ids)), sampling))
    except BaseException:
        session.close()
        raise
    return answer_events(session, stream, prompt, engine)


def answer_events(session: Session, stream: Iterable[TokenEvent | TurnEnd], prompt: chat_pb2.PromptTokens | None,
                  engine: Engine) -> Iterator[chat_pb2.ChatEvent]:
    """The events of the answer `stream` of a session opened for one request (a completion, a chat outside
    sessions): the prompt's tokens first where echoed (`prompt`), the tokens, its metrics and end, or the error
    that ended it; the session is closed when the stream ends or its reader goes away."""
    decode = engine.formatter.decode if engine.formatter is not None else None
    try:
        if prompt is not None:
            yield chat_pb2.ChatEvent(prompt=prompt)
        for event in stream:
            if isinstance(event, TokenEvent):
                yield chat_pb2.ChatEvent(token=token_delta(event, decode))
            elif isinstance(event, TurnEnd):
                yield metrics_event("", event.metrics)
                yield final_event("", event)
    except Exception as e:   # the engine failed the turn after it began: report it in the stream
        yield error_event("", e)
    finally:       # the client went away, or the answer is over: the session goes either way
        session.close()


def _scored_only(ids: list[int], prompt: chat_pb2.PromptTokens | None) -> Iterator[chat_pb2.ChatEvent]:
    if prompt is not None:
        yield chat_pb2.ChatEvent(prompt=prompt)
    metrics = TurnMetrics(prompt_tokens=len(ids), generated_tokens=0, ttft_s=0.0, tpot_s=0.0, e2e_s=0.0)
    yield metrics_event("", metrics)
    yield final_event("", TurnEnd("length", [], "", metrics))


def prompt_ids(engine: Engine, request: chat_pb2.CompleteRequest | chat_pb2.DetokenizeRequest) -> list[int]:
    """The prompt's token ids (InvalidInputError: none or both given, empty, outside the vocabulary)."""
    text = getattr(request, "text", "")
    chat = getattr(request, "messages_json", "")
    if (bool(text) + bool(request.token_ids) + bool(chat)) != 1:
        raise InvalidInputError("the prompt is text, token ids or chat messages: give exactly one")
    if chat:
        text = render_chat(_formatter(engine), chat, request.tools_json, request.continue_final_message)
    ids = list(request.token_ids) if request.token_ids else _formatter(engine).encode(text)
    vocab = engine.model_config.vocab_size
    if not ids:
        raise InvalidInputError("the prompt has no tokens")
    outside = sorted(t for t in ids if not 0 <= t < vocab)
    if outside:
        raise InvalidInputError(f"token ids must be in [0, {vocab}): got {outside[:5]}")
    return ids


def render_chat(formatter: ChatFormatter, messages_json: str, tools_json: str, continue_final: bool = False) -> str:
    """A whole chat (and the tools it may call) as the checkpoint's chat template renders it, ready for the
    assistant's answer (`continue_final`: ready to continue its last, assistant message). Control tokens
    in any message's text are refused, as in a session's turns."""
    try:
        messages = json.loads(messages_json)
        tools = json.loads(tools_json) if tools_json else None
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"the chat's messages or tools are not JSON: {e}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidInputError("the chat's messages are a list of objects")
    for m in messages:
        if isinstance(m.get("content"), str):
            formatter.check_text(m["content"])
    if continue_final and (not messages or messages[-1].get("role") != "assistant"):
        raise InvalidInputError("continue_final_message needs a final assistant message")
    text = _render(formatter, messages, tools, continue_final)
    if tools and text == _render(formatter, messages, None, continue_final):
        raise InvalidInputError("this model's chat template does not render tools: it cannot be offered any")
    return text


def _render(formatter, messages: list[dict], tools: list | None, continue_final: bool) -> str:
    try:
        return formatter.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=formatter.chat_template or chatml_template(), tokenize=False,
            add_generation_prompt=not continue_final, continue_final_message=continue_final)
    except Exception as e:      # the template's own refusals (raise_exception) and malformed messages
        raise InvalidInputError(f"the chat template cannot render this chat: {e}") from None


def _prompt_tokens(engine: Engine, ids: list[int], request: chat_pb2.CompleteRequest,
                   admit: Callable[[Callable[[], T]], T]) -> list[chat_pb2.TokenDelta]:
    """The prompt's tokens; with prompt_logprobs, each one's log probability given those before it, from
    the engine's full-prefill logits (a forward that takes a GDN slot and pages for its time: admitted as a
    turn is, freeing idle sessions' caches while it runs out of room)."""
    tokens = [chat_pb2.TokenDelta(token_id=t, index=i, token=_decode(engine, [t])) for i, t in enumerate(ids)]
    if not request.HasField("prompt_logprobs"):
        return tokens
    k = request.prompt_logprobs
    if not 0 <= k <= 20:
        raise InvalidInputError(f"prompt logprobs take 0-20 alternatives, got {k}")
    logp = torch.log_softmax(admit(lambda: engine.forward_logits(torch.tensor(ids))).float(), dim=-1)
    chosen = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    top = torch.topk(logp[:-1], k, dim=-1) if k else None
    for i, token in enumerate(tokens[1:]):
        token.logprob = chosen[i]
        if top is not None:
            token.top_logprobs.extend(chat_pb2.TokenLogprob(token_id=t, logprob=v, token=_decode(engine, [t]))
                                      for t, v in zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
    return tokens


def tokenize(engine: Engine, request: chat_pb2.TokenizeRequest) -> chat_pb2.TokenizeResponse:
    tokenizer = _formatter(engine).tokenizer
    ids = list(tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))
    return chat_pb2.TokenizeResponse(token_ids=ids, tokens=[_decode(engine, [t]) for t in ids],
                                     max_model_len=engine.max_model_len or 0)


def detokenize(engine: Engine, request: chat_pb2.DetokenizeRequest) -> chat_pb2.DetokenizeResponse:
    return chat_pb2.DetokenizeResponse(text=_decode(engine, prompt_ids(engine, request)))


def _formatter(engine: Engine):
    if engine.formatter is None:
        raise InvalidInputError("this checkpoint has no tokenizer: send token ids")
    return engine.formatter


def _decode(engine: Engine, ids: list[int]) -> str:
    return engine.formatter.decode(ids, skip_special_tokens=False) if engine.formatter is not None else ""
