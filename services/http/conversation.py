"""A stateless request's conversation as session turns, and the digests that match it to sessions.

Clients send role messages; a session runs turns (one user message, one answer). Consecutive non-assistant
messages form one turn's user message: their texts joined by a blank line, their images in order. A system
message is folded into the user message after it (sessions have no system-prompt slot). Each earlier turn
ends with the assistant's answer; the last messages are the new turn.

A history's digest chains one digest per turn over what the session saw: the user text, the sha256 of
each image, and the answer as the model produced it (surrounding whitespace ignored: clients trim). The
root binds the chain to the API key, the model, the requested recovery mode and the render options (the
chat template's variables, the images' preprocessing: a session renders every turn with the same ones), so
no other key's or model's session, nor one rendered otherwise, can match. The same digest is computed from a
session's turn log.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from google.protobuf import json_format

from raincheck_client._gen import chat_pb2

from ..common.store import TurnRecord, digest
from .errors import HttpError

SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class UserInput:
    """One turn's user message."""

    text: str
    images: tuple[bytes, ...] = ()

    @cached_property
    def image_hashes(self) -> list[str]:
        return [digest(i) for i in self.images]

    def proto(self, render: chat_pb2.RenderOptions | None = None) -> chat_pb2.UserMessage:
        return chat_pb2.UserMessage(text=self.text, images=list(self.images), render=render)


@dataclass(frozen=True)
class Exchange:
    """An earlier turn: the user message and the answer the client says came back."""

    user: UserInput
    answer: str


@dataclass(frozen=True)
class RoleMessage:
    role: str                              # system | developer | user | assistant
    text: str
    images: tuple[bytes, ...] = ()


@dataclass
class Conversation:
    history: list[Exchange]
    message: UserInput                     # the new turn
    digests: list[str] = field(default_factory=list)   # root, then one per history turn (see `bind`)

    def bind(self, owner: str, model: str, recovery_mode: str, render: chat_pb2.RenderOptions | None = None) -> None:
        """Compute the digest chain under this key, model, recovery mode and render options."""
        bound = {"v": 1, "owner": owner, "model": model, "recovery_mode": recovery_mode}
        if render is not None:
            bound["render"] = json_format.MessageToDict(render)
        root = _sha(bound)
        self.digests = [root]
        for turn in self.history:
            self.digests.append(next_digest(self.digests[-1], turn.user.text, turn.user.image_hashes, [],
                                            turn.answer))

    def digest_after(self, answer: str) -> str:
        """The digest of this history, the new message and `answer`: the session's after this turn."""
        return next_digest(self.digests[-1], self.message.text, self.message.image_hashes, [], answer)


def next_digest(previous: str, text: str, images: Sequence[str], videos: Sequence[Sequence[str]], answer: str) -> str:
    return _sha({"prev": previous, "text": text, "images": list(images), "videos": [list(v) for v in videos],
                 "answer": answer.strip()})


def record_digest(previous: str, record: TurnRecord) -> str:
    return next_digest(previous, record.text, record.images, record.videos, record.answer_text)


def _sha(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def group_turns(messages: Sequence[RoleMessage]) -> Conversation:
    """Role messages -> earlier turns + the new message (400 for shapes a session cannot run)."""
    history: list[Exchange] = []
    pending: list[RoleMessage] = []        # the user side of the turn being collected
    answers: list[str] = []                # the assistant messages closing it (consecutive ones are joined)
    for i, m in enumerate(messages):
        if m.role == "assistant":
            if not pending:
                raise HttpError.invalid(f"messages[{i}]: an assistant message must follow a user message",
                                        param=f"messages[{i}]")
            answers.append(m.text)
            continue
        if answers:
            history.append(Exchange(_merge(pending), "\n\n".join(answers)))
            pending, answers = [], []
        pending.append(m)
    if answers or not pending:
        raise HttpError.invalid("the last message must be the user's (the turn to answer); to continue a final "
                                "assistant message, send continue_final_message: true", param="messages")
    return Conversation(history, _merge(pending))


def _merge(messages: list[RoleMessage]) -> UserInput:
    text = "\n\n".join(m.text for m in messages if m.text)
    return UserInput(text, tuple(image for m in messages for image in m.images))
