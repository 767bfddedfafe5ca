"""`raincheck serve --http-port` and `raincheck http`: flags, variables, refusals, and a real process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from services import cli
from tests.demo.helpers import needs_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_flags_and_variables(monkeypatch):
    assert cli.settings(["serve"])[1]["http"].port is None                     # off unless given
    s = cli.settings(["serve", "--http-port", "0", "--http-image-urls"])[1]["http"]
    assert (s.port, s.host, s.image_urls) == (0, "127.0.0.1", True)
    monkeypatch.setenv("RAINCHECK_HTTP_PORT", "8081")
    monkeypatch.setenv("RAINCHECK_HTTP_IMAGE_TIMEOUT_S", "3")
    command, built = cli.settings(["http", "--redis-url", "redis://127.0.0.1:6379/0", "--api-keys", "k"])
    assert command == "http" and built["http"].port == 8081 and built["http"].image_fetch_timeout_s == 3
    assert built["frontend"].store.redis_url == "redis://127.0.0.1:6379/0" and built["frontend"].api_keys == ("k",)


def test_refuses_an_open_address_without_keys(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["http", "--http-host", "0.0.0.0", "--http-port", "0", "--metrics-port", "-1"])
    assert stop.value.code != 0 and "without API keys on 0.0.0.0" in str(stop.value.code) + capsys.readouterr().err


@needs_checkpoint
def test_serve_with_an_http_port():
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--plain-logs", "serve", "--port", "0",
                             "--http-port", "0", "--metrics-port", "-1", "--api-keys", "k1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RAINCHECK_LOG_LEVEL": "WARNING"})
    try:
        url = None
        for line in proc.stdout:
            if m := re.search(r"HTTP API on (http://\S+)", line):
                url = m.group(1)
                break
        assert url is not None, "serve did not announce its HTTP API"
        client = OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["demo"]
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
