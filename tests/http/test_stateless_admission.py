"""The stateless paths (completions, echo + logprobs scoring) take their GDN slot and pages through the same
admission as sessions' turns, which frees idle sessions' caches (services/decode_worker/eviction.py): lm-eval's
multiple-choice scoring after ordinary chat traffic succeeds; a 429 comes only where waiting can help, with
Retry-After; what can never fit is a 400; each error names the resource it lacks. The demo model is a
Qwen3.5 hybrid: every open session holds one of the worker's GDN state slots (64 by default)."""

from __future__ import annotations

import httpx
import pytest

from raincheck_core.errors import GDNSlotsExhaustedError, OutOfPagesError
from services.common.store import MemoryStore

from .helpers import KEYS, MODEL, Stack, user

CONTEXT = "<|im_start|>user\nwhat colour is the object in row one column one ?<|im_end|>\n<|im_start|>assistant\n"
CHOICES = ["red", "green", "blue", "yellow"]
HEADERS = {"authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def stack():
    """A worker whose key may hold 1000 sessions (the default quota would close the key's own first)."""
    s = Stack(MemoryStore(), max_sessions_per_key=1000)
    yield s
    s.close()


def test_lm_eval_scoring_after_100_idle_chat_sessions(stack):
    client = stack.openai()
    for i in range(100):       # ordinary chat traffic: each conversation a session, idle after its answer
        client.chat.completions.create(model=MODEL, messages=[user(f"what is in row {i % 12 + 1} column "
                                                                   f"{i // 12 + 1} ? ({i})")], max_tokens=1)
    engine = stack.worker.runtime.engine
    assert len(stack.worker.runtime.sessions) == engine.config.max_gdn_slots and engine.gdn.free_slots == 0
    held = len(stack.worker.runtime.sessions)
    tokens = [engine.formatter.encode(CONTEXT + c) for c in CHOICES]
    for max_tokens in (0, 1):          # lm-eval's loglikelihood requests, by token ids and by text
        for prompt in (tokens, [CONTEXT + c for c in CHOICES]):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
                                          temperature=0)
            assert [len(c.logprobs.token_logprobs) for c in r.choices] >= [len(t) for t in tokens]
            assert all(lp is not None for c in r.choices for lp in c.logprobs.token_logprobs[1:])
    assert len(stack.worker.runtime.sessions) < held       # idle sessions yielded their slots


@pytest.fixture(scope="module")
def one_slot():
    """A worker with one GDN state slot and a small page pool (32 pages of 16 tokens)."""
    s = Stack(MemoryStore(), engine={"max_gdn_slots": 1, "num_pages": 32})
    yield s
    s.close()


def score(stack: Stack, prompt) -> httpx.Response:
    return httpx.post(stack.http.url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})


def test_429_only_when_waiting_helps_with_retry_after(one_slot):
    """The only slot held by a streaming answer: 429 naming the GDN slots, with Retry-After; once the answer is
    over the same request succeeds. A prompt larger than the whole pool: a 400 in pages, whatever the load."""
    engine = one_slot.worker.runtime.engine
    with httpx.stream("POST", one_slot.http.url + "/v1/chat/completions", headers=HEADERS, timeout=120,
                      json={"model": MODEL, "messages": [user("list the objects in row one .")], "max_tokens": 400,
                            "stream": True, "ignore_eos": True}) as answer:
        lines = answer.iter_lines()
        next(line for line in lines if line.startswith("data: "))       # the answer runs: it holds the slot
        assert engine.gdn.free_slots == 0
        busy = score(one_slot, CONTEXT + "red")
        for _ in lines:
            pass
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert "GDN state slot" in busy.json()["error"]["message"] and "pages" not in busy.json()["error"]["message"]
    assert score(one_slot, CONTEXT + "red").status_code == 200
    huge = score(one_slot, "row one " * 400)
    assert huge.status_code == 400 and "32 pages" in huge.json()["error"]["message"]


def test_errors_name_the_resource_they_lack():
    assert str(GDNSlotsExhaustedError("every GDN state slot is taken", needed=1, available=0)) == \
        "every GDN state slot is taken: needs 1 GDN state slot, 0 available"
    assert str(OutOfPagesError("KV page pool exhausted", needed=3, available=1)) == \
        "KV page pool exhausted: needs 3 pages, 1 available"
