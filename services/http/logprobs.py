"""Token log probabilities in OpenAI's two shapes: chat's `{"content": [...]}` and the legacy completions'
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from collections.abc import Sequence

from raincheck_client._gen import chat_pb2

Scored = chat_pb2.TokenDelta | chat_pb2.TokenLogprob   # a token (decoded alone) with its logprob


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(tokens: Sequence[chat_pb2.TokenDelta]) -> dict:
    return {"content": [_entry(t.token, t.logprob) | {"top_logprobs": [_entry(a.token, a.logprob)
                                                                        for a in t.top_logprobs]}
                        for t in tokens], "refusal": None}


def completion_logprobs(tokens: Sequence[Scored | None], alternatives: Sequence[Sequence[chat_pb2.TokenLogprob]],
                        texts: Sequence[str], start: int = 0) -> dict:
    """`tokens[i]` scored (None: the first prompt token, which nothing predicts), `alternatives[i]` its
    top tokens, `texts[i]` its text; offsets count characters from `start`."""
    offsets, at = [], start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": list(texts),
            "token_logprobs": [None if t is None else t.logprob for t in tokens],
            "top_logprobs": [None if t is None else {a.token: a.logprob for a in alts}
                             for t, alts in zip(tokens, alternatives, strict=True)],
            "text_offset": offsets}
