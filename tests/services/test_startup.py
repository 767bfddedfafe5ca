"""Startup rules, metrics endpoint and the CLI's wiring."""

from __future__ import annotations

import logging
import shutil
import subprocess
import urllib.request

import pytest

from raincheck_client import Client, Unavailable
from services.cli import _parser
from services.common.metrics import serve_metrics
from services.common.settings import FrontendSettings, frontend_settings, worker_settings
from services.common.store import MemoryStore
from services.frontend.server import FrontendServer
from tests.multimodal.mm_helpers import png


def test_no_keys_refused_off_loopback_unless_allowed(caplog):
    store = MemoryStore()
    with pytest.raises(SystemExit, match=r"refusing to serve without API keys on 0\.0\.0\.0"):
        FrontendServer(FrontendSettings(host="0.0.0.0", port=0), store)
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
                 "raincheck:requests_total{code=\"OK\",method=\"Chat\",service=\"frontend\"}"):
        assert name in body, name


def test_cli_flags_and_environment(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k2\n\nk3\n")
    monkeypatch.setenv("RAINCHECK_API_KEYS", "k1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/5")
    monkeypatch.setenv("RAINCHECK_DRAIN_TIMEOUT_S", "30")
    args = _parser().parse_args(["serve", "--port", "0", "--api-keys-file", str(keys), "--metrics-port", "-1",
                                 "--model", "/ckpt", "--policy", "full", "--num-pages", "64",
                                 "--recovery-mode", "disaggregated"])
    front, worker = frontend_settings(args), worker_settings(args)
    assert front.api_keys == ("k1", "k2", "k3") and front.metrics_port is None and front.port == 0
    assert (front.default_recovery_mode, front.drain_s, front.metrics_host) == ("disaggregated", 30.0, "127.0.0.1")
    assert front.store.redis_url == "redis://127.0.0.1:6379/5"
    assert (worker.model, worker.default_policy, worker.engine) == ("/ckpt", "full", {"num_pages": 64})
    monkeypatch.setenv("RAINCHECK_METRICS_HOST", "0.0.0.0")
    worker_args = _parser().parse_args(["decode-worker", "--port", "7", "--worker-id", "w", "--advertise", "h:7"])
    w = worker_settings(worker_args)
    assert (w.port, w.worker_id, w.advertise, w.metrics_port, w.metrics_host) == (7, "w", "h:7", 9465, "0.0.0.0")
    assert w.recovery_modes == ("colocated",) and (w.deferred.ray_address, w.deferred.workers) == (None, 1)


def test_recovery_and_ray_settings(monkeypatch, capsys):
    monkeypatch.setenv("RAINCHECK_RECOVERY_MODES", "colocated, disaggregated")
    monkeypatch.setenv("RAINCHECK_RAY_NAMESPACE", "ns")
    monkeypatch.setenv("RAINCHECK_DEFERRED_NUM_GPUS", "1")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    w = worker_settings(_parser().parse_args(["decode-worker", "--deferred-timeout-s", "9",
                                              "--deferred-resource", ""]))
    assert w.recovery_modes == ("colocated", "disaggregated")
    d = w.deferred
    assert (d.ray_address, d.namespace, d.num_gpus, d.num_cpus, d.resource, d.timeout_s) == \
        ("ray://head:10001", "ns", 1.0, 1.0, "", 9.0)
    monkeypatch.delenv("RAINCHECK_RECOVERY_MODES")
    serve = worker_settings(_parser().parse_args(["serve"]))
    assert serve.recovery_modes == ("colocated",)
    serve = worker_settings(_parser().parse_args(["serve", "--deferred-workers", "3"]))
    assert serve.recovery_modes == ("colocated", "disaggregated") and serve.deferred.workers == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["decode-worker", "--recovery-modes", "colocated,remote"])
    assert "recovery modes are colocated, disaggregated" in capsys.readouterr().err


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
