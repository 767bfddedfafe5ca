"""`raincheck serve --model PATH` on a tiny MoE checkpoint written here, through the SDK and the HTTP API."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI
from PIL import Image

from raincheck_client import Client
from services.common.random_model import save_random_model
from tests.http.helpers import user

ROOT = Path(__file__).resolve().parents[2]


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_serve_a_moe_checkpoint_through_the_sdk_and_http(tmp_path, family):
    folder = save_random_model(tmp_path / family, "tiny", family=family)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--plain-logs", "serve", "--model", str(folder),
                             "--port", "0", "--http-port", "0", "--metrics-port", "-1", "--api-keys", "k1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RAINCHECK_LOG_LEVEL": "WARNING"})
    try:
        address = url = None
        for line in proc.stdout:
            if m := re.search(r"raincheck serving (\S+) on (\S+)", line):
                model, address = m.groups()
            if m := re.search(r"HTTP API on (http://\S+)", line):
                url = m.group(1)
                break
        assert address is not None and url is not None, "serve did not announce its addresses"
        with Client(address, api_key="k1", timeout_s=120) as client:
            session = client.create_session(policy="raincheck", retention=0.3)
            turn = session.send("what is this ?", images=[_png()], max_new_tokens=6, ignore_eos=True)
            assert turn.result().finish_reason == "length"
            assert session.send("and now ?", max_new_tokens=3, ignore_eos=True).result().finish_reason == "length"
            session.close()
        openai = OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=120)
        assert [m.id for m in openai.models.list()] == [model]
        r = openai.chat.completions.create(model=model, messages=[user("what is this ?", _png())], max_tokens=4)
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 4
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
