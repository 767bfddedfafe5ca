"""Chat completions outside sessions that need more than the text completion path renders: a chat with
images (`CompleteRequest.images`, one per `{"type": "image"}` part of its messages), or with render options
(template variables, the images' pixel range) or without the assistant prompt. The whole chat, tools
included, is rendered by the checkpoint's template (`ChatFormatter.chat_prompt`), its images encoded into
the prompt, and answered once in an engine session opened for it and closed after (as completions.py
answers the rest)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TypeVar

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, InvalidInputError

from .completions import answer_events
from .convert import to_render, to_sampling

T = TypeVar("T")


def renders_here(request: chat_pb2.CompleteRequest) -> bool:
    """The request is a chat this module answers (else completions.py does)."""
    return bool(request.messages_json) and (bool(request.images) or request.HasField("render")
                                            or request.HasField("add_generation_prompt"))


def complete_chat(engine: Engine, request: chat_pb2.CompleteRequest, max_new_tokens: int,
                  admit: Callable[[Callable[[], T]], T]) -> Iterator[chat_pb2.ChatEvent]:
    """Check, render and admit the chat now (typed errors raise here); the returned stream runs it."""
    if request.text or request.token_ids or request.echo or request.HasField("prompt_logprobs"):
        raise InvalidInputError("a chat is its messages alone: no text, token ids, echo or prompt logprobs")
    o = request.sampling
    if o.HasField("n") and o.n != 1:
        raise InvalidInputError("a chat outside a session runs one answer: n must be 1")
    formatter = engine.formatter
    if formatter is None:
        raise InvalidInputError("this checkpoint has no tokenizer: it cannot render a chat")
    try:
        messages = json.loads(request.messages_json)
        tools = json.loads(request.tools_json) if request.tools_json else None
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"the chat's messages or tools are not JSON: {e}") from None
    mc = engine.model_config
    prompt = formatter.chat_prompt(
        messages, [bytes(i) for i in request.images], vision=engine.vision, image_token_id=mc.image_token_id,
        video_token_id=mc.video_token_id, vision_start_id=mc.vision_start_token_id,
        vision_end_id=mc.vision_end_token_id, tools=tools, render=to_render(request.render),
        continue_final=request.continue_final_message,
        add_generation_prompt=request.add_generation_prompt if request.HasField("add_generation_prompt") else True)
    sampling = to_sampling(o, max_new_tokens)
    session = admit(engine.open_session)
    try:
        stream = admit(lambda: session.turn(prompt, sampling))
    except BaseException:
        session.close()
        raise
    return answer_events(session, stream, None, engine)
