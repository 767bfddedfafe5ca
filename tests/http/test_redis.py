"""Session matching across HTTP frontends that share Redis (as separate processes would): the index lives
in the store, a tip is taken by exactly one request, and its entries expire with the sessions."""

from __future__ import annotations

import threading
import time

import redis

from services.common.redis_store import RedisStore
from services.common.store import MemoryStore
from services.http.index import MemoryIndex, RedisIndex, Tip, make_index
from tests.services.conftest import REDIS_URL, redis_store

from .helpers import MAX_TOKENS, MODEL, Stack, assistant, data_url, dialogue, user


def test_a_conversation_moves_between_frontends(redis_prefix):
    stack = Stack(redis_store(redis_prefix))
    try:
        other = stack.another_http()
        d = dialogue(seed=9)
        q, image = [x.text for x in d.questions], d.scene.png()
        messages, seen = [], []
        for i, (question, server) in enumerate(zip(q, [stack.http, other, stack.http], strict=True)):
            messages.append(user(question, image if i == 0 else None))
            r = stack.openai(server=server).chat.completions.create(model=MODEL, messages=messages,
                                                                   max_tokens=MAX_TOKENS)
            messages.append(assistant(r.choices[0].message.content))
            seen.append((r.model_extra["raincheck"], r.usage.prompt_tokens_details.cached_tokens))
        assert [s["match"] for s, _ in seen] == ["new", "continued", "continued"]
        assert len({s["session_id"] for s, _ in seen}) == 1 and all(cached > 0 for _, cached in seen[1:])
        client = redis.Redis.from_url(REDIS_URL)
        tips = list(client.scan_iter(match=redis_prefix + "http:tip:*"))
        turns = list(client.scan_iter(match=redis_prefix + "http:turn:*"))
        assert len(tips) == 1 and len(turns) == 3
        assert 0 < client.pttl(tips[0]) <= stack.store.session_ttl_ms
        client.close()
    finally:
        stack.close()


def test_a_responses_conversation_moves_between_frontends(redis_prefix):
    """previous_response_id names a response any frontend sharing the Redis can continue, with its images."""
    stack = Stack(redis_store(redis_prefix))
    try:
        other = stack.another_http()
        d = dialogue(seed=9)
        q = [x.text for x in d.questions]
        first = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(d.scene.png())},
                                              {"type": "input_text", "text": q[0]}]}]
        r1 = stack.openai().responses.create(model=MODEL, input=first, max_output_tokens=MAX_TOKENS)
        r2 = stack.openai(server=other).responses.create(model=MODEL, input=q[1], previous_response_id=r1.id,
                                                         max_output_tokens=MAX_TOKENS)
        assert r2.model_extra["raincheck"]["match"] == "continued" and r2.usage.input_tokens_details.cached_tokens > 0
        assert stack.openai(server=other).responses.retrieve(r1.id).output_text == r1.output_text
        client = redis.Redis.from_url(REDIS_URL)
        (key,) = [k for k in client.scan_iter(match=redis_prefix + "http:response:*") if r1.id in k.decode()]
        assert 0 < client.pttl(key) <= stack.store.session_ttl_ms
        client.close()
        stack.openai(server=other).responses.delete(r1.id)
        assert stack.store.redis.get(key) is None
    finally:
        stack.close()


def _claims_race(index, digest: str) -> list:
    index.publish("k", ["root", digest], Tip("s1", 10))
    won: list = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        won.append(index.claim(digest))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_a_tip_is_claimed_once(redis_prefix):
    store = RedisStore(REDIS_URL, redis_prefix)
    for index in (make_index(store), make_index(MemoryStore())):
        won = _claims_race(index, "d1")
        assert sorted(won, key=lambda t: t is not None) == [None] * 7 + [Tip("s1", 10)]
        index.release("d1", Tip("s1", 10))              # a turn that did not start puts it back
        assert index.claim("d1") == Tip("s1", 10)
        index.publish("k", ["root", "d1"], Tip("s2", 12))
        index.release("d1", Tip("s1", 10))              # but never over a newer tip
        assert index.claim("d1") == Tip("s2", 12)
        assert index.source("d1").session_id == "s2" and index.source("d1").turns == 1
    store.close()


def test_entries_expire_with_the_sessions(redis_prefix):
    memory = MemoryIndex(ttl_s=0.05)
    memory.publish("k", ["root", "d1"], Tip("s1", 3))
    time.sleep(0.1)
    assert memory.claim("d1") is None and memory.source("d1") is None
    store = RedisStore(REDIS_URL, redis_prefix, session_ttl_s=0.05)
    index = RedisIndex(store)
    index.publish("k", ["root", "d1"], Tip("s1", 3))
    time.sleep(0.15)
    assert index.claim("d1") is None and index.source("d1") is None
    store.close()


def test_eviction_takes_the_least_recently_used_idle_session(redis_prefix):
    store = RedisStore(REDIS_URL, redis_prefix)
    for index in (make_index(store), make_index(MemoryStore())):
        index.publish("k", ["r", "a1"], Tip("a", 5))
        index.publish("k", ["r", "b1"], Tip("b", 5))
        index.publish("other", ["r2", "c1"], Tip("c", 5))
        index.publish("k", ["r", "a1", "a2"], Tip("a", 9))       # a's next turn: now the most recent
        assert index.evict("k") == "b" and index.claim("b1") is None
        busy = index.claim("a2")                                   # a turn of `a` is running
        assert index.evict("k") is None
        index.publish("k", ["r", "a1", "a2", "a3"], Tip(busy.session_id, 12))   # it ends
        assert index.evict("k") == "a" and index.evict("k") is None
        assert index.evict("other") == "c"
    store.close()
