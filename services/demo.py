"""`raincheck demo` (what `make demo` runs): the embedded default end to end.

A frontend and a decode worker start in this process (gRPC over loopback, in-process store); the
client SDK then plays one scripted multi-turn dialogue under each policy — full, hard, raincheck,
post_answer — printing every answer with its TTFT and TPOT, and how much of the turn's visuals was
deferred and still pending when the answer ended. A second image arrives mid-conversation, as in real
chats: every new image is a new deferral. Where the checkpoint ships an MTP head (demo-v2 does), the
dialogue is played once more under `full` on a worker that verifies the head's drafts (speculative
decoding, k = 3): the same answers, in fewer decode steps. It serves the default model, the demo model ("demo": v2,
`models/demo-v2`, which reads images arriving at any turn), unless `--model` names another checkpoint
(`--model demo-v1`: v1, which answers from the first image only).
"""

from __future__ import annotations

import logging
import random

from raincheck_client import Client
from raincheck_client.events import Final, Metrics
from raincheck_core.config import ModelConfig
from raincheck_core.models.shipped import resolve_model_path
from raincheck_demo.world import NUMBERS, Dialogue, Question, make_multi_dialogue

from .common.model_loading import default_model
from .common.settings import FrontendSettings, WorkerSettings
from .common.store import MemoryStore

POLICIES = ("full", "hard", "raincheck", "post_answer")
DEMO_SEED = 0
DRAFTS = 3          # MTP drafts verified per decode step in the speculative section


def demo_model(model: str | None) -> str | None:
    """The checkpoint asked for; else the default model ("demo" when present; None: random)."""
    return model if model is not None else default_model()


def demo_dialogue(seed: int) -> Dialogue:
    """Two images: the first with the opening question, the second with a later turn."""
    return make_multi_dialogue(random.Random(seed), images=2, turns=4, text_first=0.0)


# Seed DEMO_SEED's dialogue: image one with turn 1, image two with turn 3, questions about image one in
# turns 1, 2 and 4. With v2 at 30% DivPrune, `full` answers all four, `hard` only turn 3 (the other cells
# asked about were pruned), and `raincheck` turns 2, 3 and 4: image one's deferred part is back by then. Turns 1 and 3
# are the arrival turns, where raincheck has only the kept part of the new image, like hard.
def run_demo(model: str | None, max_new_tokens: int, seed: int = DEMO_SEED) -> None:
    for name in ("services", "raincheck_core"):    # the demo's own lines are the output
        logging.getLogger(name).setLevel(logging.WARNING)
    model = demo_model(model)
    if model is None:
        print("The demo model is not in this checkout: serving a RANDOM model (answers are noise).")
    dialogue = demo_dialogue(seed)
    sizes = ", ".join(f"image {NUMBERS[i + 1]} {v.scene.rows}x{v.scene.cols} with turn {v.turn + 1}"
                      for i, v in enumerate(dialogue.visuals))
    with _Cluster(WorkerSettings(model=model, port=0, metrics_port=None)) as cluster:
        print(f"embedded default on {cluster.address}: model {cluster.model}; {sizes} (one visual token per cell)\n")
        for policy in POLICIES:
            print(f"== {policy}")
            _play(cluster, policy, dialogue, max_new_tokens)
    if model is not None and ModelConfig.from_folder(resolve_model_path(model)).mtp_layers:
        settings = WorkerSettings(model=model, port=0, metrics_port=None, speculative_method="mtp",
                                  speculative_tokens=DRAFTS)
        with _Cluster(settings) as cluster:
            print(f"== full, verifying {DRAFTS} drafts a step from the checkpoint's MTP head (the same answers)")
            _play(cluster, "full", dialogue, max_new_tokens, drafts=True)


class _Cluster:
    """A frontend and a decode worker of `settings` in this process, over loopback, with a client."""

    def __init__(self, settings: WorkerSettings):
        from .decode_worker.server import DecodeWorkerServer
        from .frontend.server import FrontendServer

        self.store = MemoryStore(3600)
        self.worker = DecodeWorkerServer(settings, self.store).start()
        self.front = FrontendServer(FrontendSettings(port=0, metrics_port=None), self.store).start()
        self.address, self.model = self.front.address, self.worker.model
        self.client = Client(self.address)

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.front.stop(1.0)
        self.worker.stop(1.0)
        self.store.close()


def _play(cluster: _Cluster, policy: str, dialogue: Dialogue, max_new_tokens: int, drafts: bool = False) -> None:
    """The dialogue in one session under `policy`, each answer printed with its metrics."""
    session = cluster.client.create_session(policy=policy, retention=0.3, chunk_size=15, guard=4)
    for i, question in enumerate(dialogue.questions):
        message = dialogue.message(i)
        final, metrics = _run(session.send(question.text, images=message.images, max_new_tokens=max_new_tokens))
        answer = " ".join(final.text.split())
        ok = "ok " if answer == question.answer else "-- "
        arrives = "".join(f" [+ image {NUMBERS[k + 1]}]" for k, v in enumerate(dialogue.visuals) if v.turn == i)
        print(f"  T{i + 1} {ok}Q: {question.text}{arrives}\n       A: {answer!r}{_items(answer, question)}")
        extra = f", barrier wait {1e3 * metrics.barrier_wait_s:.1f} ms" if i else ""
        if drafts:
            extra = f", drafts accepted {metrics.drafts_accepted} of {metrics.drafts_proposed}"
        print(f"       TTFT {1e3 * metrics.ttft_s:6.1f} ms  TPOT {1e3 * metrics.tpot_s:5.1f} ms  "
              f"deferred {metrics.deferred_tokens}, pending at answer end {metrics.deferred_pending}{extra}")
    session.close()


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
