"""`raincheck serve --backend flex`: the flag reaches the worker's engine, and the demo model served on
FlexAttention over gRPC answers a two-turn image chat exactly as the native kernels do in process (fixed
deferred chunks: tpot_slo 0)."""

from __future__ import annotations

from raincheck_core import Engine, Message, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models.shipped import shipped_folder
from services import cli
from services.common.store import MemoryStore
from tests.multimodal.mm_helpers import png
from tests.services.conftest import Cluster

POLICY = dict(policy="raincheck", retention=0.3, chunk_size=7, guard=2)
TURNS = [("what is this ?", [png(128, 96)]), ("and the blue one ?", [])]


def _native(folder) -> list[list[int]]:
    engine = Engine.from_pretrained(folder, backend="native")
    session = engine.open_session(deferral=DeferralConfig(**POLICY, tpot_slo=None))
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True)
    return [session.turn(Message(text, images=images), sampling).result().token_ids for text, images in TURNS]


def _served(cluster: Cluster) -> list[list[int]]:
    store = MemoryStore()
    cluster.worker(store, engine={"backend": "flex"})
    session = cluster.client(cluster.frontend(store)).create_session(**POLICY, tpot_slo=0)
    answers = []
    for text, images in TURNS:
        turn = session.send(text, images=images, max_new_tokens=10, ignore_eos=True, follow_recovery=True)
        list(turn)
        answers.append(turn.final.token_ids)
    session.close()
    return answers


def test_serve_backend_flex_answers_as_native():
    worker = cli.settings(["serve", "--backend", "flex", "--model", "demo"])[1]["worker"]
    assert worker.engine["backend"] == worker.model_spec().engine["backend"] == "flex"
    folder = shipped_folder("demo")
    cluster = Cluster(folder)
    try:
        assert _served(cluster) == _native(folder)
    finally:
        cluster.close()
