"""SGLang's native API (`/generate`, `/get_model_info`) as SGLang's frontend language drives it through
`RuntimeEndpoint`: the whole program text each call, rendered with the qwen2-vl chat template (its
default system prompt included), the image as base64 in `image_data`, streamed answers as cumulative text.
The requests here are built exactly as RuntimeEndpoint builds them; test_sglang_frontend.py runs the real
frontend where the sglang package is installed."""

from __future__ import annotations

import base64
import itertools
import json
import re

import httpx
import pytest

from services.http.sglang_api import GENERATION_PROMPT, IMAGE

from .helpers import KEYS, MODEL, dialogue

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
HEADERS = {"authorization": f"Bearer {KEYS[0]}"}
# what RuntimeEndpoint.generate sends for sgl.gen(max_tokens=48, temperature=0) with the qwen2-vl template
SAMPLING = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 48,
            "min_new_tokens": 0, "n": 1, "stop": ["<|im_end|>"], "stop_token_ids": None, "stop_regex": None,
            "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def generate(stack, text: str, image: bytes, **extra) -> dict:
    body = {"text": text, "sampling_params": SAMPLING, "image_data": base64.b64encode(image).decode(), **extra}
    r = httpx.post(stack.http.url + "/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def generate_stream(stack, text: str, image: bytes) -> tuple[str, dict]:
    """As RuntimeEndpoint.generate_stream reads it: `data:` lines of cumulative text until `data: [DONE]`."""
    body = {"text": text, "sampling_params": SAMPLING, "image_data": base64.b64encode(image).decode(),
            "stream": True}
    pos, answer, meta = 0, "", None
    with httpx.stream("POST", stack.http.url + "/generate", json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        data = json.loads(line[5:])
        answer += data["text"][pos:]
        pos = len(data["text"])
        meta = data["meta_info"]
    return answer, meta


def test_model_info_names_the_chat_template_runtime_endpoint_picks(stack):
    """RuntimeEndpoint picks its chat template by matching model_path against model names (SGLang's
    `match_chat_ml`: `qwen.*vl` is qwen2-vl); a bare "demo" matched none, and it fell back to the wrong one."""
    r = httpx.get(stack.http.url + "/get_model_info", headers=HEADERS)
    info = r.json()
    assert r.status_code == 200 and info["is_generation"] and info["served_model_name"] == MODEL
    assert re.search(r"qwen.*vl", info["model_path"], re.IGNORECASE) and info["chat_template"] == "qwen2-vl"


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_program_continues_one_session(stack, stream):
    d = dialogue(seed=16)
    image = d.scene.png()
    text = SYSTEM + user(IMAGE + d.questions[0].text) + GENERATION_PROMPT
    metas, answers = [], []
    for i, question in enumerate(d.questions):
        if i:
            text += user(question.text) + GENERATION_PROMPT
        if stream:
            answer, meta = generate_stream(stack, text, image)
        else:
            out = generate(stack, text, image)
            answer, meta = out["text"], out["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        answers.append(answer)
        metas.append(meta)
        text += answer + "<|im_end|>\n"            # what the program appends: the answer, the role's suffix
    assert [m["raincheck"]["match"] for m in metas] == ["new", "continued", "continued"]
    assert len({m["raincheck"]["session_id"] for m in metas}) == 1
    # a new session: nothing, or whole pages the prefix cache holds of this program's earlier run
    assert metas[0]["cached_tokens"] % 16 == 0 and metas[0]["cached_tokens"] < metas[0]["prompt_tokens"]
    for before, meta in itertools.pairwise(metas):
        assert meta["cached_tokens"] == before["prompt_tokens"] + before["completion_tokens"] - 1
        assert meta["raincheck"]["deferred_tokens"] == 0 and meta["raincheck"]["prefilled_tokens"] < 40


def test_prefill_only_requests_are_answered_without_running(stack):
    """RuntimeEndpoint's cache_prefix / fill_image: max_new_tokens 0. Sessions prefill with their turn."""
    d = dialogue(seed=2)
    body = {"text": SYSTEM + "<|im_start|>user\n" + IMAGE, "sampling_params": {"max_new_tokens": 0},
            "image_data": base64.b64encode(d.scene.png()).decode()}
    sessions = stack.worker.runtime.stats().sessions
    r = httpx.post(stack.http.url + "/generate", json=body, headers=HEADERS)
    assert r.status_code == 200 and r.json()["text"] == "" and r.json()["meta_info"]["completion_tokens"] == 0
    assert stack.worker.runtime.stats().sessions == sessions


CHOICES = ["red", "green", "blue"]


def test_scoring_answers_sgl_select_with_the_prompts_logprobs(stack):
    """What `RuntimeEndpoint.select` sends for `sgl.select(choices=...)`: a batch of the program plus each choice,
    max_new_tokens 0, return_logprob from logprob_start_len. Each prompt's logprobs are the stateless completion's
    (/v1/completions with echo, lm-eval's loglikelihood), by text and by token ids, and no session is opened."""
    program = SYSTEM + user("what colour is the object in row one column two ?") + GENERATION_PROMPT
    sessions = stack.worker.runtime.stats().sessions
    body = {"text": [program + c for c in CHOICES], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 3}
    r = httpx.post(stack.http.url + "/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert len(answers) == len(CHOICES)
    for choice, answer in zip(CHOICES, answers, strict=True):
        meta = answer["meta_info"]
        echo = httpx.post(stack.http.url + "/v1/completions", headers=HEADERS, timeout=120, json={
            "model": MODEL, "prompt": program + choice, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
        expected = echo["choices"][0]["logprobs"]
        assert meta["prompt_tokens"] == len(expected["tokens"]) and meta["output_token_logprobs"] == []
        assert [t for _, _, t in meta["input_token_logprobs"]] == expected["tokens"][3:]
        assert [lp for lp, _, _ in meta["input_token_logprobs"]] == pytest.approx(expected["token_logprobs"][3:])
        assert meta["input_token_logprobs"][-1][2] == choice
    ids = [[i for _, i, _ in a["meta_info"]["input_token_logprobs"]] for a in answers]
    by_ids = httpx.post(stack.http.url + "/generate", headers=HEADERS, timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0})
    scored = [a["meta_info"]["input_token_logprobs"] for a in by_ids.json()]
    assert [[i for _, i, _ in s] for s in scored] == ids and all(s[0][0] is None and s[0][2] is None for s in scored)
    one = httpx.post(stack.http.url + "/generate", headers=HEADERS, timeout=120, json={**body, "text": program}).json()
    prefix = answers[0]["meta_info"]["input_token_logprobs"][:-1]        # one prompt: its object, not a list
    assert [t[1:] for t in one["meta_info"]["input_token_logprobs"]] == [t[1:] for t in prefix]
    # select's first request caches the program and reads where scoring starts from its prompt_tokens
    cached = httpx.post(stack.http.url + "/generate", headers=HEADERS, timeout=120,
                        json={"text": program, "sampling_params": {"max_new_tokens": 0}}).json()
    assert cached["meta_info"]["prompt_tokens"] == one["meta_info"]["prompt_tokens"] == len(prefix) + 3
    assert stack.worker.runtime.stats().sessions == sessions


@pytest.mark.parametrize(("body", "field"), [
    ({"text": [], "image_data": "aGk="}, "image_data"),
    ({"text": ["a"], "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"text": ["a", ""]}, "text"),
    ({"input_ids": [[1, 2], []]}, "input_ids"),
    ({}, "text"),
])
def test_what_scoring_cannot_take_is_a_400_naming_the_field(stack, body, field):
    r = httpx.post(stack.http.url + "/generate", headers=HEADERS, json={
        "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("body", "message"), [
    ({"text": "The capital of France is"}, "generation prompt"),
    ({"text": "hello " + user("hi") + GENERATION_PROMPT}, "not a ChatML conversation"),
    ({"text": user(IMAGE + "what is this ?") + GENERATION_PROMPT}, "1 image placeholders"),
    ({"text": [user("a") + GENERATION_PROMPT] * 2}, "batches are scored only"),
    ({"input_ids": [1, 2, 3]}, "batches are scored only"),
    ({"text": user("hi") + GENERATION_PROMPT, "sampling_params": {"regex": "[a-z]+"}}, "regex"),
    ({"text": user("hi") + GENERATION_PROMPT, "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": user("hi") + GENERATION_PROMPT, "sampling_params": {"beam_width": 4}}, "unknown sampling parameter"),
    ({"text": user("hi") + GENERATION_PROMPT, "return_logprob": True}, "return_logprob needs max_new_tokens 0"),
    ({"text": user("hi") + GENERATION_PROMPT, "image_data": "%%%"}, "not valid base64"),
    ({"text": "<|im_start|>assistant\n" + IMAGE + "<|im_end|>\n" + GENERATION_PROMPT, "image_data": "aGk="},
     "only user messages hold images"),
])
def test_bad_generate_requests_are_400(stack, body, message):
    r = httpx.post(stack.http.url + "/generate", json=body, headers=HEADERS)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_generate_needs_the_key(stack):
    r = httpx.post(stack.http.url + "/generate", json={"text": user("hi") + GENERATION_PROMPT})
    assert r.status_code == 401


def test_sglang_sampling_rules_and_json_schema_are_honoured(stack):
    from tests.demo.helpers import FOLDER, engine

    text = user("is there a red object in row one ?") + GENERATION_PROMPT
    schema = {"sampling_params": {"json_schema": '{"type": "boolean"}', "max_new_tokens": 8}}
    r = httpx.post(stack.http.url + "/generate", json={"text": text, **schema}, headers=HEADERS)
    assert r.status_code == 200 and r.json()["text"] in ("true", "false")
    token = engine(FOLDER).formatter.encode(" blue")[-1]
    biased = {"sampling_params": {"logit_bias": {str(token): 100}, "max_new_tokens": 3, "min_new_tokens": 3}}
    r = httpx.post(stack.http.url + "/generate", json={"text": text, **biased}, headers=HEADERS)
    assert r.status_code == 200 and r.json()["text"] == " blue blue blue"
