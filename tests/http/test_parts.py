"""The HTTP frontend's parts without servers: turn grouping and digests, stop strings, ChatML parsing,
image references (a local HTTP server stands in for an image host)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import pytest

from services.common.store import TurnRecord, digest
from services.http.conversation import RoleMessage, group_turns, record_digest
from services.http.errors import HttpError
from services.http.images import ImageLoader
from services.http.sglang_api import GENERATION_PROMPT, IMAGE, parse_chatml
from services.http.stops import StopMatcher


def test_turns_group_user_side_messages_and_fold_system():
    conv = group_turns([RoleMessage("system", "be brief"), RoleMessage("user", "hi", (b"img",)),
                        RoleMessage("assistant", "hello"), RoleMessage("assistant", "there"),
                        RoleMessage("user", "and?"), RoleMessage("user", "well?", (b"b",))])
    assert [(t.user.text, t.user.images, t.answer) for t in conv.history] == [("be brief\n\nhi", (b"img",),
                                                                               "hello\n\nthere")]
    assert (conv.message.text, conv.message.images) == ("and?\n\nwell?", (b"b",))


def test_digests_bind_key_model_and_content_and_match_the_turn_log():
    def conv(answer: str = "red circle", owner: str = "k1", model: str = "demo", image: bytes = b"png"):
        c = group_turns([RoleMessage("user", "q1", (image,)), RoleMessage("assistant", answer),
                         RoleMessage("user", "q2")])
        c.bind(owner, model, "")
        return c

    base = conv().digests
    assert conv("  red circle\n").digests == base            # surrounding whitespace of answers: clients trim
    for other in (conv("red square"), conv(owner="k2"), conv(model="other"), conv(image=b"png2")):
        assert other.digests[-1] != base[-1]
    logged = TurnRecord("q1", [digest(b"png")], [], [1, 2, 3], "red circle", "stop")
    assert record_digest(base[0], logged) == base[1]


@pytest.mark.parametrize(("pieces", "stops", "keep", "shown", "matched"), [
    (["one red ", "circle t", "wo blue"], [" two "], False, "one red circle", " two "),
    (["one red circle t", "wo", " blue"], ["two"], True, "one red circle two", "two"),
    (["a", "b", "c"], ["bd"], False, "abc", None),            # a held-back prefix is shown at the end
    (["xyz"], [], False, "xyz", None),
])
def test_stop_strings_over_streamed_pieces(pieces, stops, keep, shown, matched):
    m = StopMatcher(stops, keep=keep)
    out = "".join(m.feed(p) for p in pieces)
    if m.matched is None:
        out += m.flush()
    assert (out, m.matched) == (shown, matched)


def test_chatml_parsing():
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n" + IMAGE + "what is this ?<|im_end|>\n"
            "<|im_start|>assistant\nred circle<|im_end|>\n<|im_start|>user\nand left ?<|im_end|>\n"
            + GENERATION_PROMPT)
    messages = parse_chatml(text, [b"img"])
    assert [(m.role, m.text, m.images) for m in messages] == [
        ("system", "be brief", ()), ("user", "what is this ?", (b"img",)), ("assistant", "red circle", ()),
        ("user", "and left ?", ())]


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body = b"x" * (2048 if self.path == "/big.png" else 100)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass        # the loader gave up first (the timeout the slow image is there to hit)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_image_references(image_host):
    loader = ImageLoader(max_bytes=1024, allow_urls=True, timeout_s=0.3)

    def load(ref: str, **kw) -> bytes:
        return asyncio.run(loader.load(ref, "img", **kw))

    assert load("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    assert load(base64.b64encode(b"abc").decode(), bare_base64=True) == b"abc"
    assert load(image_host + "/ok.png") == b"x" * 100
    for ref, message in [(image_host + "/big.png", "larger than 1024 bytes"),
                         (image_host + "/missing.png", "returned HTTP 404"),
                         (image_host + "/slow.png", "took longer than 0.3 s"),
                         ("data:image/png;base64," + base64.b64encode(b"y" * 2000).decode(), "the limit is 1024")]:
        with pytest.raises(HttpError, match=message) as e:
            load(ref)
        assert e.value.status == 400
    with pytest.raises(HttpError, match="does not fetch image URLs"):
        asyncio.run(ImageLoader(1024, allow_urls=False, timeout_s=1).load(image_host + "/ok.png", "img"))
