"""`raincheck demo` (what `make demo` runs): the embedded default end to end.

A frontend and a decode worker start in this process (gRPC over loopback, in-process store); the
client SDK then plays one scripted multi-turn dialogue about a rendered scene under each policy —
full, hard, raincheck, post_answer — printing every answer with its TTFT and TPOT, and how much of
the image was deferred and still pending when the answer ended.
"""

from __future__ import annotations

import logging
import random

from raincheck_client import Client
from raincheck_client.events import Final, Metrics
from raincheck_core.models.demo.world import make_dialogue

from .common.settings import FrontendSettings, WorkerSettings
from .common.store import make_store
from .decode_worker.loading import default_model

POLICIES = ("full", "hard", "raincheck", "post_answer")


def run_demo(model: str | None, max_new_tokens: int, seed: int = 7) -> None:
    from .decode_worker.server import DecodeWorkerServer
    from .frontend.server import FrontendServer

    for name in ("services", "raincheck_core"):    # the demo's own lines are the output
        logging.getLogger(name).setLevel(logging.WARNING)
    model = model or default_model()
    if model is None:
        print("The demo model is not in this checkout: serving a RANDOM model (answers are noise).")
    store = make_store(None, "raincheck-demo:", 3600)
    worker = DecodeWorkerServer(WorkerSettings(model=model, port=0, metrics_port=None), store).start()
    front = FrontendServer(FrontendSettings(port=0, metrics_port=None), store).start()
    dialogue = make_dialogue(random.Random(seed))
    image = dialogue.scene.png()
    print(f"embedded default on {front.address}: model {worker.model}, scene {dialogue.scene.rows}x"
          f"{dialogue.scene.cols} ({dialogue.scene.rows * dialogue.scene.cols} visual tokens)\n")
    try:
        with Client(front.address) as client:
            for policy in POLICIES:
                print(f"== {policy}")
                session = client.create_session(policy=policy, retention=0.3, chunk_size=15, guard=4)
                for i, question in enumerate(dialogue.questions):
                    turn = session.send(question.text, images=[image] if i == 0 else [],
                                        max_new_tokens=max_new_tokens)
                    final, metrics = _run(turn)
                    ok = "ok " if final.text.strip() == question.answer else "-- "
                    print(f"  T{i + 1} {ok}Q: {question.text}\n       A: {final.text.strip()!r} "
                          f"(expected {question.answer!r})")
                    print(f"       TTFT {1e3 * metrics.ttft_s:6.1f} ms  TPOT {1e3 * metrics.tpot_s:5.1f} ms  "
                          f"deferred {metrics.deferred_tokens}, pending at answer end {metrics.deferred_pending}"
                          + (f", barrier wait {1e3 * metrics.barrier_wait_s:.1f} ms" if i else ""))
                session.close()
    finally:
        front.stop(1.0)
        worker.stop(1.0)
        store.close()


def _run(turn) -> tuple[Final, Metrics]:
    final = metrics = None
    for event in turn:
        if isinstance(event, Final):
            final = event
        elif isinstance(event, Metrics):
            metrics = event
    if final is None or metrics is None:
        raise RuntimeError("the turn ended without its final event and metrics")
    return final, metrics
