"""The HTTP API's edges as real clients meet them (issue 43): an error code on every error, the models'
real `created`, `GET /tokenizer_info`, and CORS for browser apps (`--allowed-origins`)."""

from __future__ import annotations

import time

import httpx
import pytest

from services.http.server import HttpServer
from services.http.settings import HttpSettings
from tests.demo.helpers import FOLDER

from .helpers import KEYS, MODEL, user

AUTH = {"authorization": f"Bearer {KEYS[0]}"}
ORIGIN = "https://app.example"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [user("hi")], "max_tokens": 2, **fields}


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "code", "param"), [
    ("post", "/v1/chat/completions", chat(), {}, 401, "invalid_api_key", None),
    ("post", "/v1/chat/completions", chat(no_such_field=1), AUTH, 400, "unknown_parameter", "no_such_field"),
    ("post", "/v1/chat/completions", chat(audio={"voice": "alloy"}), AUTH, 400, "unsupported_parameter", "audio"),
    ("post", "/v1/chat/completions", {"messages": [user("hi")]}, AUTH, 400, "missing_required_parameter", "model"),
    ("post", "/v1/chat/completions", chat(messages=[user("hi", b"not an image")]), AUTH, 400, "invalid_argument",
     None),
    ("post", "/v1/chat/completions", chat(model="gpt-9"), AUTH, 404, "not_found", None),
    ("post", "/v1/chat/completions", chat(stream_options={"include_usage": True}), AUTH, 400, "invalid_value",
     "stream_options"),
    ("get", "/v1/models/gpt-9", None, AUTH, 404, "model_not_found", "model"),
    ("get", "/v1/nothing-here", None, AUTH, 404, "not_found", None),
    ("get", "/v1/chat/completions", None, AUTH, 405, "method_not_allowed", None),
    ("post", "/generate", {"text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                           "sampling_params": {"bogus": 1}}, AUTH, 400, "unknown_parameter", "sampling_params.bogus"),
])
def test_every_error_has_a_code(stack, method, path, body, headers, status, code, param):
    r = httpx.request(method, stack.http.url + path, json=body, headers=headers, timeout=60)
    err = r.json()["error"]
    assert r.status_code == status and set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param and err["message"]


def test_an_invalid_json_body_has_a_code(stack):
    r = httpx.post(stack.http.url + "/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_models_report_when_they_were_loaded(stack):
    listed = stack.openai().models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert stack.worker.started_at - 1 <= listed[0].created <= time.time()
    assert stack.openai().models.retrieve(MODEL).created == listed[0].created


def test_tokenizer_info_is_what_a_client_needs_to_tokenize_locally(stack):
    r = httpx.get(stack.http.url + "/tokenizer_info", headers=AUTH)
    info = r.json()
    assert r.status_code == 200 and info["tokenizer_class"].endswith("Tokenizer")
    assert info["chat_template"] == (FOLDER / "chat_template.jinja").read_text()
    assert info["eos_token"] == "<|im_end|>" and info["turn_end_token"] == "<|im_end|>"
    assert {"<|im_start|>", "<|im_end|>", "<|image_pad|>"} <= set(info["special_tokens"])
    assert info["max_model_len"] == info["model_max_length"] == 4096
    # every special token id it lists is the tokenizer's own (/tokenize agrees)
    for token_id, text in info["added_tokens"].items():
        ids = httpx.post(stack.http.url + "/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]
        assert ids == [int(token_id)]
    assert info["stop_token_ids"] and all(0 <= t < info["vocab_size"] for t in info["stop_token_ids"])
    assert not {"name_or_path", "vocab_file", "merges_file"} & set(info)     # no paths of the worker's disk
    assert httpx.get(stack.http.url + "/tokenizer_info", params={"model": MODEL}, headers=AUTH).json()["model"] == MODEL
    assert httpx.get(stack.http.url + "/tokenizer_info", params={"model": "gpt-9"}, headers=AUTH).status_code == 404
    assert httpx.get(stack.http.url + "/tokenizer_info").status_code == 401


@pytest.fixture(scope="module")
def cors_url(stack):
    """A second HTTP frontend on the stack's store, with CORS for ORIGIN."""
    server = HttpServer(HttpSettings(port=0, allowed_origins=(ORIGIN,)), stack.frontend_settings, stack.store).start()
    stack.https.append(server)
    return server.url


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})


def test_a_preflight_from_an_allowed_origin_gets_the_cors_headers(cors_url):
    r = preflight(cors_url, ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # the request itself, answered or refused, carries the header the browser checks
    for headers, status in ((AUTH, 200), ({}, 401)):
        r = httpx.post(cors_url + "/v1/chat/completions", json=chat(), headers={**headers, "origin": ORIGIN},
                       timeout=60)
        assert r.status_code == status and r.headers["access-control-allow-origin"] == ORIGIN


def test_other_origins_and_a_server_without_origins_get_no_cors_headers(stack, cors_url):
    r = preflight(cors_url, "https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = preflight(stack.http.url, ORIGIN)         # off by default
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["code"] == "method_not_allowed"
