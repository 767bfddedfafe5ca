"""Startup rules, metrics endpoint, TLS. (The CLI's flags and errors: test_cli.py.)"""

from __future__ import annotations

import logging
import shutil
import subprocess
import urllib.request

import pytest

from raincheck_client import Client, Unavailable
from services.common.metrics import serve_metrics
from services.common.settings import FrontendSettings
from services.common.store import MemoryStore
from services.frontend.server import FrontendServer
from tests.multimodal.mm_helpers import png


def test_no_keys_refused_off_loopback_unless_allowed(caplog):
    store = MemoryStore()
    with pytest.raises(ValueError, match=r"refusing to serve without API keys on 0\.0\.0\.0"):
        FrontendSettings(host="0.0.0.0", port=0)      # refused by the settings, before anything starts
    with caplog.at_level(logging.WARNING):
        server = FrontendServer(FrontendSettings(host="0.0.0.0", port=0, allow_no_auth=True), store)
    assert "WITHOUT authentication" in caplog.text
    server.stop(0)
    FrontendServer(FrontendSettings(host="0.0.0.0", port=0, api_keys=("k",)), store).stop(0)


def test_metrics_endpoint_on_loopback(embedded):
    cluster, frontend, _ = embedded
    session = cluster.client(frontend).create_session(policy="raincheck", retention=0.3)
    session.send("what is this ?", images=[png()], max_new_tokens=3, follow_recovery=True).text()
    session.send("and the blue one ?", max_new_tokens=2).text()
    port = serve_metrics(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("raincheck:time_to_first_token_seconds_count{service=\"frontend\"}",
                 "raincheck:time_to_first_token_seconds_count{service=\"decode_worker\"}",
                 "raincheck:inter_token_latency_seconds_bucket", "raincheck:e2e_request_latency_seconds_sum",
                 "raincheck:deferred_tokens_pending{", "raincheck:recovery_latency_seconds_count{mode=\"colocated\"}",
                 "raincheck:recovery_bytes_shipped_count{mode=\"colocated\"}", "raincheck:barrier_wait_seconds_count",
                 "raincheck:step_cost_drift{",
                 "raincheck:requests_total{code=\"OK\",method=\"Chat\",service=\"frontend\"}"):
        assert name in body, name


def test_client_reports_an_unreachable_server():
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(Unavailable):
        client.list_models()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(cluster, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    store = MemoryStore()
    cluster.worker(store)
    frontend = cluster.frontend(store, tls_cert=str(cert), tls_key=str(key), api_keys=("k",))
    with Client(frontend.address, api_key="k", tls=cert.read_bytes()) as client:
        assert client.create_session().send("hi", max_new_tokens=2).result().finish_reason in ("stop", "length")
    with Client(frontend.address, api_key="k", timeout_s=5) as plaintext, pytest.raises(Unavailable):
        plaintext.list_models()
