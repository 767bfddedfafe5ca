"""An answer's text with the special tokens the model generates (vLLM's `skip_special_tokens: false`).

The engine decodes answers without special tokens. Asked to keep them, the worker decodes each answer's
token ids again as they stream, special tokens included, and puts that text in the token and final events.
The token that ended the answer (a stop token) stays out, as vLLM leaves it out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from raincheck_client._gen import chat_pb2
from raincheck_core import Engine


def keep_special_tokens(engine: Engine, sampling: chat_pb2.SamplingOptions, events: Iterator[chat_pb2.ChatEvent]
                        ) -> Iterator[chat_pb2.ChatEvent]:
    """`events` as they are, or, where `sampling` says `skip_special_tokens: false`, with each answer's text
    decoded with its special tokens."""
    if not sampling.HasField("skip_special_tokens") or sampling.skip_special_tokens or engine.formatter is None:
        return events
    stops = set() if sampling.ignore_eos else engine.stop_token_ids() | set(sampling.stop_token_ids)
    spaces = sampling.spaces_between_special_tokens if sampling.HasField("spaces_between_special_tokens") else True
    return _redecoded(events, engine.formatter.tokenizer, stops, spaces)


@dataclass
class _Answer:
    ids: list[int] = field(default_factory=list)
    text: str = ""                 # what the token events have carried


def _redecoded(events: Iterator[chat_pb2.ChatEvent], tokenizer, stops: set[int], spaces: bool
               ) -> Iterator[chat_pb2.ChatEvent]:
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)

    answers: dict[int, _Answer] = {}
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "token":
            token = event.token
            a = answers.setdefault(token.choice, _Answer())
            token.text = ""
            if token.token_id not in stops:     # a stop token ends the answer: it is not part of it
                a.ids.append(token.token_id)
                text = decode(a.ids)
                if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                    token.text, a.text = text[len(a.text):], text
        elif kind == "final":
            final = event.final
            ids = list(final.token_ids)
            if final.finish_reason == "stop" and ids and ids[-1] in stops:
                ids = ids[:-1]
            final.text = decode(ids)
        yield event
