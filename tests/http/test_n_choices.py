"""`n > 1` through the official openai client: n choices from one prefill (a step hook on the worker's
engine reads the pool: the prompt's pages are shared by refcount, each answer has pages of its own), the
prompt counted once, seeded choice i equal to a one-answer request with seed + i (streamed chunks carry
their index, logprobs per choice), a continuation of choice 0 continues the session and of any other choice
forks one, n too large for the pool is a 400 in pages, and the answers' pages go back."""

from __future__ import annotations

import openai
import pytest

from .helpers import MODEL, assistant, user

QUESTION = "what colour is the object in row one column one ?"


def ask(stack, **kwargs):
    return stack.openai().chat.completions.create(model=MODEL, messages=[user(QUESTION)], **kwargs)


def test_n_choices_share_the_prompt(stack):
    engine = stack.worker.runtime.engine
    stack.settle()
    seen: list[tuple[list[int], list[list[int]], list[int]]] = []

    def snapshot(_stats) -> None:    # under the engine lock, after each step
        branches = {s: c for s, c in engine.core.caches.items() if "#" in s}
        if len(branches) == 2 and all(c.length for c in branches.values()):     # forked
            parent = engine.core.caches[next(iter(branches)).split("#")[0]]
            seen.append((list(parent.table.pages), [list(c.table.pages) for c in branches.values()],
                         list(engine.kv.refs)))

    remove = engine.on_step(snapshot)
    try:
        r = ask(stack, max_tokens=12, n=3, extra_body={"ignore_eos": True})
    finally:
        remove()
    one = ask(stack, max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}    # greedy
    assert r.usage.prompt_tokens == one.usage.prompt_tokens                                # counted once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens == 36
    parent, branches, refs = seen[0]
    full = r.usage.prompt_tokens // engine.kv.page_size
    assert full >= 1
    for pages in branches:
        assert pages[:full] == parent[:full] and not set(pages[full:]) & set(parent)
        assert all(refs[p] == 1 for p in pages[full:])
    assert all(refs[p] >= 3 for p in parent[:full])
    assert not set(branches[0][full:]) & set(branches[1][full:])
    stack.settle()
    assert not [s for s in engine.core.caches if "#" in s]         # the other answers' pages went back


def test_seeded_choices_stream_with_their_index(stack):
    kwargs = dict(max_tokens=8, temperature=1.5, seed=11, logprobs=True)
    chunks = list(ask(stack, n=2, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, scored, finished = ["", ""], [0, 0], set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            scored[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    usage = chunks[-1].usage
    singles = [ask(stack, **{**kwargs, "seed": 11 + i}) for i in (0, 1)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert texts[0] != texts[1]                                   # seed + i: the answers differ
    assert scored == [s.usage.completion_tokens for s in singles]
    assert usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_any_choice_can_be_continued(stack):
    question = "what colour is the object in row three column two ?"    # a history no other test leaves
    r = stack.openai().chat.completions.create(model=MODEL, messages=[user(question)], n=2, max_tokens=8,
                                               temperature=1.5, seed=9)
    answers = [c.message.content for c in r.choices]
    assert answers[0] != answers[1]
    session = r.model_extra["raincheck"]["session_id"]
    for i, match in ((1, "forked"), (0, "continued")):
        messages = [user(question), assistant(answers[i]), user("and row two column two ?")]
        nxt = stack.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        details = nxt.model_extra["raincheck"]
        assert details["match"] == match and (details["session_id"] == session) == (i == 0)
        assert nxt.choices[0].message.content


def test_n_too_large_for_the_pool_is_400(stack):
    with pytest.raises(openai.BadRequestError, match=r"n=128 answers of up to 2000 tokens .* need .* KV pages"):
        ask(stack, n=128, max_tokens=2000)


def test_n_is_refused_where_it_cannot_work(stack):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError, match="n > 1 cannot be combined with tools"):
        ask(stack, n=2, tools=tools)
    with pytest.raises(openai.BadRequestError, match="n is not supported"):
        stack.openai().completions.create(model=MODEL, prompt="hi", n=2, max_tokens=2)
