"""The tokenizer over HTTP: `/tokenize` and `/detokenize`, in vLLM's and SGLang's shapes, and `GET
/tokenizer_info` (vLLM's: what lm-eval and SGLang read instead of loading the tokenizer locally); the
frontend's Tokenize, Detokenize and TokenizerInfo, answered by a worker serving the model."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from raincheck_client._gen import chat_pb2

from ..frontend.servicer import ChatServicer
from .call import HttpCall


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = ""
    tokens: list[int] = Field(min_length=1)


def add_routes(app: FastAPI, servicer: ChatServicer, blocking: Callable[..., Awaitable]) -> None:
    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        reply = await blocking(servicer.Tokenize, chat_pb2.TokenizeRequest(
            model=body.model, text=body.prompt, add_special_tokens=body.add_special_tokens),
            HttpCall.of(request))
        ids = list(reply.token_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": reply.max_model_len,
                "token_strs": list(reply.tokens)}

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        reply = await blocking(servicer.Detokenize, chat_pb2.DetokenizeRequest(model=body.model, token_ids=body.tokens),
                               HttpCall.of(request))
        return {"prompt": reply.text, "text": reply.text}

    @app.get("/tokenizer_info", response_model=None)
    async def tokenizer_info(request: Request, model: str = "") -> dict[str, Any]:
        reply = await blocking(servicer.TokenizerInfo, chat_pb2.TokenizerInfoRequest(model=model),
                               HttpCall.of(request))
        return json.loads(reply.info_json) | ({"model": model} if model else {})
