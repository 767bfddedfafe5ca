"""Under a per-key session quota, stateless clients keep working: a new conversation closes the key's
least recently used idle session that the HTTP API matched, and that conversation forks when it returns."""

from __future__ import annotations

import pytest

from services.common.store import MemoryStore
from services.frontend.auth import key_id
from tests.demo.helpers import FOLDER

from .helpers import KEYS, MAX_TOKENS, MODEL, Stack, assistant, dialogue, user


@pytest.fixture(scope="module")
def small_quota():
    if not (FOLDER / "model.safetensors").is_file():
        pytest.skip("models/demo has no trained checkpoint")
    s = Stack(MemoryStore(), max_sessions_per_key=2)
    yield s
    s.close()


def test_the_least_recently_used_session_makes_room(small_quota):
    stack = small_quota
    client = stack.openai()
    chats = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):     # c is the third: a (least recently used) goes
        d = dialogue(seed)
        messages = [user(d.questions[0].text, d.scene.png())]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        chats[name] = (d, [*messages, assistant(r.choices[0].message.content)], r.model_extra["raincheck"])
    assert stack.store.open_sessions(key_id(KEYS[0])) == 2

    def next_turn(name: str) -> dict:
        d, messages, _ = chats[name]
        r = client.chat.completions.create(model=MODEL, messages=[*messages, user(d.questions[1].text)],
                                           max_tokens=MAX_TOKENS)
        return r.model_extra["raincheck"]

    assert next_turn("b")["match"] == "continued"
    assert next_turn("a")["match"] == "forked"             # its session was closed; it comes back re-prefilled
    assert next_turn("c")["match"] == "forked"             # ... closing c's, the least recently used then
