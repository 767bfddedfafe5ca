"""Deterministic mode: how often the same greedy conversation gets another answer, and what the mode costs.

    python -m bench.determinism --runs 10 --json bench/out/determinism.json

An embedded server (demo model, the TPOT objective on: tpot_slo 1.10) with its gRPC and HTTP frontends.
For each mode (default, deterministic) and condition (alone; while another client streams long image
answers), the same 2-turn image conversation (raincheck policy, default selector, retention 0.3) runs
`--runs` times through the SDK and through the openai client. Reported: distinct answers per path, and the
SDK turns' mean TPOT.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import threading
from contextlib import nullcontext
from pathlib import Path

from openai import OpenAI

from raincheck_client import Client, Final, Metrics
from raincheck_demo.world import make_dialogue
from services.common import native_heap
from services.common.settings import FrontendSettings, WorkerSettings
from services.common.store import MemoryStore
from services.decode_worker.server import DecodeWorkerServer
from services.frontend.server import FrontendServer
from services.http.server import HttpServer
from services.http.settings import HttpSettings

MAX_TOKENS = 48


def _user(text: str, image: bytes | None) -> dict:
    if image is None:
        return {"role": "user", "content": text}
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


def sdk_run(client: Client, questions: list[str], image: bytes, policy: dict) -> tuple[str, list[float]]:
    session = client.create_session(**policy)
    ids, tpots = [], []
    for i, q in enumerate(questions):
        events = list(session.send(q, images=[image] if i == 0 else [], max_new_tokens=MAX_TOKENS))
        ids.append(next(e for e in events if isinstance(e, Final)).token_ids)
        tpots.append(next(e for e in events if isinstance(e, Metrics)).tpot_s)
    session.close()
    return str(ids), tpots


def http_run(client: OpenAI, questions: list[str], image: bytes, policy: dict) -> str:
    messages, answers = [], []
    for i, q in enumerate(questions):
        messages.append(_user(q, image if i == 0 else None))
        r = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, extra_body=policy)
        answers.append(r.choices[0].message.content)
        messages.append({"role": "assistant", "content": answers[-1]})
    return json.dumps(answers)


class Load:
    """Another client streaming long image answers until stopped."""

    def __init__(self, client: Client, image: bytes):
        self.stop = threading.Event()
        self.turns = 0

        def run() -> None:
            session = client.create_session(policy="raincheck", retention=0.3)
            while not self.stop.is_set():
                session.send("what is this ?", images=[image], max_new_tokens=120, ignore_eos=True).text()
                self.turns += 1
            session.close()
        self.thread = threading.Thread(target=run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join(timeout=300)


def run(runs: int, model: str) -> dict:
    native_heap.bound()
    store = MemoryStore()
    settings = WorkerSettings(model=model, model_name="demo", port=0, metrics_port=None)
    worker = DecodeWorkerServer(settings, store).start()
    front = FrontendSettings(port=0, metrics_port=None)
    grpc_front = FrontendServer(front, store).start()
    http = HttpServer(HttpSettings(port=0), front, store, grpc_front.router).start()
    d = make_dialogue(random.Random(16), turns=2)
    questions, image = [q.text for q in d.questions], d.scene.png()
    other = make_dialogue(random.Random(3), turns=1).scene.png()
    out: dict[str, dict] = {}
    try:
        with Client(grpc_front.address) as client, Client(grpc_front.address) as loader:
            openai = OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=300)
            for mode in ("default", "deterministic"):
                policy = dict(policy="raincheck", retention=0.3, deterministic=mode == "deterministic")
                for condition in ("alone", "loaded"):
                    sdk, web, tpots = set(), set(), []
                    with Load(loader, other) if condition == "loaded" else nullcontext():
                        for _ in range(runs):
                            ids, t = sdk_run(client, questions, image, policy)
                            sdk.add(ids)
                            tpots += t
                            web.add(http_run(openai, questions, image, policy))
                    row = {"sdk_distinct": len(sdk), "http_distinct": len(web),
                           "tpot_ms": round(1e3 * statistics.fmean(tpots), 2)}
                    out[f"{mode}/{condition}"] = row
                    print(f"{mode:13s} {condition:6s} {row}", flush=True)
    finally:
        http.stop(0)
        grpc_front.stop(0)
        worker.stop(0)
    return {"runs": runs, "results": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run(args.runs, args.model)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
