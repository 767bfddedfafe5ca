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
from raincheck_core.models.demo.world import Question, make_dialogue

from .common.settings import FrontendSettings, WorkerSettings
from .common.store import make_store
from .decode_worker.loading import default_model

POLICIES = ("full", "hard", "raincheck", "post_answer")


# Seed 16's dialogue opens with a long answer (a 12-object list) whose row the 30% selection mostly
# misses: the fused chunks restore it while the answer is written, which `hard` cannot.
def run_demo(model: str | None, max_new_tokens: int, seed: int = 16) -> None:
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
                    answer = " ".join(final.text.split())
                    ok = "ok " if answer == question.answer else "-- "
                    print(f"  T{i + 1} {ok}Q: {question.text}\n       A: {answer!r}{_items(answer, question)}")
                    print(f"       TTFT {1e3 * metrics.ttft_s:6.1f} ms  TPOT {1e3 * metrics.tpot_s:5.1f} ms  "
                          f"deferred {metrics.deferred_tokens}, pending at answer end {metrics.deferred_pending}"
                          + (f", barrier wait {1e3 * metrics.barrier_wait_s:.1f} ms" if i else ""))
                session.close()
    finally:
        front.stop(1.0)
        worker.stop(1.0)
        store.close()


def _items(answer: str, question: Question) -> str:
    """How much of a wrong answer is right: list items in place, or just the expected answer."""
    if answer == question.answer:
        return ""
    if question.kind != "list":
        return f" (expected {question.answer!r})"
    got, ref = answer.split(), question.answer.split()
    right = sum(got[i:i + 3] == ref[i:i + 3] for i in range(0, len(ref), 3))
    return f" ({right} of {len(ref) // 3} objects right)"


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
