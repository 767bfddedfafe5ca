"""The official openai client against the HTTP frontend on loopback: multi-turn image chats continue one
session (cached tokens, no image re-prefill) and answer exactly as the gRPC SDK does; diverging histories
fork without touching the original; concurrent identical requests get sessions of their own."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from .helpers import KEYS, MAX_TOKENS, MODEL, assistant, dialogue, user

IMAGE_TOKENS = 144                     # a 12 x 12 scene


def sdk_answers(stack, questions, image, **policy) -> list[str]:
    """The dialogue through the gRPC SDK, on the same worker."""
    stack.settle()
    session = stack.sdk().create_session(**policy)
    answers = [session.send(q, images=[image] if i == 0 else [], max_new_tokens=MAX_TOKENS).text()
               for i, q in enumerate(questions)]
    session.close()
    return answers


def play(client, questions, image, *, stream: bool, **extra) -> list:
    """The dialogue through the openai client, resending the whole conversation each turn (as chat apps
    do); per turn: (answer, usage, raincheck details)."""
    messages, turns = [], []
    for i, question in enumerate(questions):
        messages.append(user(question, image if i == 0 else None))
        turn = complete(client, messages, stream=stream, **extra)
        messages.append(assistant(turn[0]))
        turns.append(turn)
    return turns


def complete(client, messages, *, stream: bool = False, **extra) -> tuple:
    kwargs = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, extra_body=extra or None)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, r.usage, r.model_extra["raincheck"]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, chunks[-1].usage, finish[0].model_extra["raincheck"]


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_image_chat_continues_one_session(stack, stream):
    d = dialogue(seed=16)
    questions, image = [q.text for q in d.questions], d.scene.png()
    expected = sdk_answers(stack, questions, image)
    continued = metric("raincheck:http_session_matches_total", result="continued")

    stack.settle()
    turns = play(stack.openai(), questions, image, stream=stream)

    assert [answer for answer, _, _ in turns] == expected
    sessions = {details["session_id"] for _, _, details in turns}
    assert len(sessions) == 1 and [t[2]["match"] for t in turns] == ["new", "continued", "continued"]
    first, later = turns[0], turns[1:]
    # the SDK ran the same first message on this worker (`expected`): whole pages of it, short of its last
    # row, come from the prefix cache
    cached = first[1].prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0
    assert first[2]["prefilled_tokens"] + first[2]["deferred_tokens"] + cached == first[1].prompt_tokens > IMAGE_TOKENS
    for (_, usage, details), (_, before, _) in zip(later, turns, strict=False):
        # the session held everything up to this turn: the earlier turns, image included, are cached;
        # the worker prefilled only the new message (and the previous answer's last token)
        assert usage.prompt_tokens_details.cached_tokens == before.prompt_tokens + before.completion_tokens - 1
        assert details["prefilled_tokens"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        assert details["prefilled_tokens"] < 40 and details["deferred_tokens"] == 0
    assert metric("raincheck:http_session_matches_total", result="continued") == continued + 2

    # the worker holds exactly what the usage says: the whole conversation but the last sampled token
    stack.settle()
    (session_id,) = sessions
    last = turns[-1][1]
    assert stack.sdk().session(session_id).status().cached_tokens == last.prompt_tokens + last.completion_tokens - 1


def test_edited_history_forks_and_the_original_continues(stack):
    d = dialogue(seed=7)
    q, image = [x.text for x in d.questions], d.scene.png()
    edited = d.questions[2].text                 # turn 2 asks turn 3's question instead
    full = {"policy": "full"}                    # a forked (re-prefilled) history equals the original exactly
    expected = sdk_answers(stack, q, image, **full)
    expected_edit = sdk_answers(stack, [q[0], edited], image, **full)
    client = stack.openai()

    stack.settle()
    (a1, _, t1), (a2, _, t2) = play(client, q[:2], image, stream=False, **full)
    assert [a1, a2] == expected[:2] and t1["session_id"] == t2["session_id"]

    hits = metric("raincheck:prefix_cache_hit_tokens_total")
    fork, usage, details = complete(client, [user(q[0], image), assistant(a1), user(edited)], **full)
    assert details["match"] == "forked" and details["session_id"] != t1["session_id"]
    assert fork == expected_edit[1]
    # the fork re-prefills its history, all but what it shares with the original (first message, image,
    # first answer): that comes from the prefix cache
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > IMAGE_TOKENS and details["prefilled_tokens"] == usage.prompt_tokens - cached
    assert metric("raincheck:prefix_cache_hit_tokens_total") == hits + cached

    # the original session is untouched: its next turn continues it and answers as the SDK's did
    a3, usage, details = complete(client, [user(q[0], image), assistant(a1), user(q[1]), assistant(a2),
                                           user(q[2])], **full)
    assert details["match"] == "continued" and details["session_id"] == t1["session_id"]
    assert a3 == expected[2] and usage.prompt_tokens_details.cached_tokens > IMAGE_TOKENS

    # the fork is a session of its own, continued in turn
    _, _, details = complete(client, [user(q[0], image), assistant(a1), user(edited), assistant(fork), user(q[1])],
                             **full)
    assert details["match"] == "continued" and details["session_id"] != t1["session_id"]


def test_history_the_server_did_not_produce(stack):
    """An assistant message edited by the client (or a conversation from elsewhere): a new session whose
    history is re-prefilled from the request, the answer tokenized by the worker; it then continues."""
    d = dialogue(seed=3)
    q, image = [x.text for x in d.questions], d.scene.png()
    client = stack.openai()
    messages = [user(q[0], image), assistant("red circle"), user(q[1])]
    a2, usage, details = complete(client, messages)
    assert details["match"] == "forked" and usage.prompt_tokens_details.cached_tokens == 0
    _, usage, follow = complete(client, [*messages, assistant(a2), user(q[2])])
    assert follow["match"] == "continued" and follow["session_id"] == details["session_id"]
    assert usage.prompt_tokens_details.cached_tokens > IMAGE_TOKENS

    # a real conversation brought from elsewhere (no session of this key logged it): re-tokenized from its
    # text, it leads to the answer the original session gives
    expected = sdk_answers(stack, q[:2], image, policy="full")
    answer, _, bob = complete(stack.openai(KEYS[1]), [user(q[0], image), assistant(expected[0]), user(q[1])],
                              policy="full")
    assert bob["match"] == "forked" and answer == expected[1]


def test_concurrent_requests_with_one_history_get_sessions_of_their_own(stack):
    d = dialogue(seed=11)
    q, image = [x.text for x in d.questions], d.scene.png()
    client = stack.openai()
    a1, _, first = complete(client, [user(q[0], image)], policy="full")
    messages = [user(q[0], image), assistant(a1), user(q[1])]
    results: list = [None, None]

    def run(i: int) -> None:
        results[i] = complete(stack.openai(), messages, policy="full")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    matches = sorted(r[2]["match"] for r in results)
    sessions = {r[2]["session_id"] for r in results}
    assert matches == ["continued", "forked"] and len(sessions) == 2 and first["session_id"] in sessions
    assert results[0][0] == results[1][0]            # full policy, greedy: the fork answers the same


def test_sessions_belong_to_their_key(stack):
    d = dialogue(seed=5)
    q, image = [x.text for x in d.questions], d.scene.png()
    a1, _, alice = complete(stack.openai(KEYS[0]), [user(q[0], image)])
    _, _, bob = complete(stack.openai(KEYS[1]), [user(q[0], image), assistant(a1), user(q[1])])
    assert bob["match"] == "forked" and bob["session_id"] != alice["session_id"]
    _, _, again = complete(stack.openai(KEYS[0]), [user(q[0], image), assistant(a1), user(q[1])])
    assert again["match"] == "continued" and again["session_id"] == alice["session_id"]


def test_a_stop_string_cuts_the_answer_and_ends_reuse(stack):
    d = dialogue(seed=16)                        # turn 1 lists twelve objects: "one ... two ..."
    q, image = [x.text for x in d.questions], d.scene.png()
    client = stack.openai()
    r = client.chat.completions.create(model=MODEL, messages=[user(q[0], image)], max_tokens=MAX_TOKENS,
                                       stop=[" two "])
    cut = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and cut.startswith("one ") and " two " not in cut
    assert r.usage.completion_tokens < 12
    # the session holds more than the client saw: the next request re-prefills the history
    _, usage, details = complete(client, [user(q[0], image), assistant(cut), user(q[1])])
    assert details["match"] == "forked" and usage.prompt_tokens_details.cached_tokens == 0


def test_models_and_health(stack):
    assert [m.id for m in stack.openai().models.list()] == [MODEL]
    import httpx

    r = httpx.get(stack.http.url + "/health")
    assert r.status_code == 200 and r.json()["models"] == [MODEL]


def test_a_client_that_leaves_mid_answer_cancels_the_turn(stack):
    d = dialogue(seed=4)
    stack.settle()
    stream = stack.openai().chat.completions.create(
        model=MODEL, messages=[user(d.questions[0].text, d.scene.png())], max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stack.settle(timeout_s=10)
    turn = list(stack.worker.runtime.sessions.values())[-1].stream.request    # of the session just opened
    assert turn.finished and len(turn.generated) < MAX_TOKENS                 # stopped, not run to its end
