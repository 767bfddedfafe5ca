"""Readiness as a client sees it: wait for health, then chat at once, on fresh `raincheck serve` starts.

    python -m bench.readiness --starts 20 --json bench/out/readiness.json

Each start is a new `raincheck serve` process (demo model, a gRPC and an HTTP port). Through the SDK: poll
`grpc.health.v1` (service "") until SERVING, then a 2-turn image chat. Through HTTP: poll `/health` until
200, then the same chat with the openai client. A start succeeds when both turns answer. Also reported:
how long after the process started health said SERVING (what the model load and the warm-up cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from bench.determinism import http_run, sdk_run
from bench.local_server import free_port
from raincheck_client import Client
from raincheck_demo.world import make_dialogue

POLICY = dict(policy="raincheck", retention=0.3)


def _grpc_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(ready: Callable[[], bool], process: subprocess.Popen, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and process.poll() is None:
        if ready():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def one_start(path: str, model: str, questions: list[str], image: bytes, timeout_s: float) -> dict:
    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "services.cli", "serve", "--model", model, "--port", str(port),
               "--http-port", str(http_port), "--metrics-port", "-1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    out: dict = {"path": path}
    try:
        ready = _wait(lambda: _grpc_serving(address) if path == "sdk" else _http_ok(url), process, timeout_s)
        out["ready_s"] = None if ready is None else round(ready, 2)
        try:
            if ready is None:
                raise TimeoutError("health never said serving")
            if path == "sdk":
                with Client(address) as client:
                    sdk_run(client, questions, image, POLICY)
            else:
                http_run(OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), questions,
                         image, POLICY)
            out["ok"] = True
        except Exception as e:   # what a client would see: the start failed
            out.update(ok=False, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=20, help="fresh starts per path (SDK, HTTP)")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    d = make_dialogue(random.Random(16), turns=2)
    questions, image = [q.text for q in d.questions], d.scene.png()
    runs = []
    for path in ("sdk", "http"):
        for i in range(args.starts):
            runs.append(one_start(path, args.model, questions, image, args.timeout_s))
            print(f"{path} start {i + 1}: {runs[-1]}", flush=True)
    summary = {path: {"ok": sum(r["ok"] for r in runs if r["path"] == path), "starts": args.starts,
                      "median_ready_s": sorted(r["ready_s"] or 0 for r in runs if r["path"] == path)[args.starts // 2]}
               for path in ("sdk", "http")}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
