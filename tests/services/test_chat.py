"""Two-turn image chat through the SDK -> frontend -> decode worker (colocated recovery), sync and asyncio."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from raincheck_client import AsyncClient, Final, Metrics, RecoveryProgress, Token
from raincheck_client._gen import chat_pb2
from raincheck_core import Engine, Message, SamplingParams
from raincheck_core.deferral.policy import DeferralConfig
from services._gen import worker_pb2, worker_pb2_grpc
from tests.multimodal.mm_helpers import png

POLICY = dict(policy="raincheck", retention=0.3, chunk_size=7, guard=2)
TURNS = [("what is this ?", [png(128, 96)]), ("and the blue one ?", [])]


def _reference(checkpoint) -> list[list[int]]:
    """The same conversation on an Engine, in process."""
    engine = Engine.from_pretrained(checkpoint)
    session = engine.open_session(deferral=DeferralConfig(**POLICY, tpot_slo=None))
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return [session.turn(Message(text, images=images), sampling).result().token_ids for text, images in TURNS]


def test_two_turn_image_chat(embedded, checkpoint):
    cluster, frontend, worker = embedded
    client = cluster.client(frontend)
    assert [(m.name, m.workers, m.recovery_modes) for m in client.list_models()] == [("tiny", 1, ["colocated"])]
    session = client.create_session(**POLICY, tpot_slo=0)    # 0: fixed chunks, as in the reference
    assert (session.info.policy, session.info.chunk_size, session.info.tpot_slo, session.info.recovery_mode) == \
        ("raincheck", 7, None, "colocated")
    assert session.info.barrier_timeout_s is None          # the server's default: wait at the barrier

    text, images = TURNS[0]
    turn = session.send(text, images=images, max_new_tokens=12, ignore_eos=True, follow_recovery=True)
    events = list(turn)
    tokens = [e for e in events if isinstance(e, Token)]
    progress = [e for e in events if isinstance(e, RecoveryProgress)]
    assert [t.index for t in tokens] == list(range(12))
    assert turn.metrics.deferred_tokens > 0 and turn.metrics.generated_tokens == 12
    assert turn.final.finish_reason == "length" and turn.final.token_ids == [t.token_id for t in tokens]
    assert turn.final.text == "".join(t.text for t in tokens)
    assert progress[0].pending_tokens == turn.metrics.deferred_tokens     # reported as the answer starts
    assert events[-1] == progress[-1] and progress[-1].complete and progress[-1].pending_tokens == 0
    assert isinstance(events[-3], Metrics) and isinstance(events[-2], Final)

    status = session.status()
    assert (status.status, status.turns, status.pending_deferred_tokens) == ("idle", 1, 0)
    assert status.worker_id == worker.worker_id and status.cached_tokens > 0

    text, images = TURNS[1]
    # a bounded barrier for this turn only (nothing is pending after follow_recovery: the same answer)
    second = session.send(text, max_new_tokens=12, ignore_eos=True, policy={"barrier_timeout_s": 0.0})
    answer = second.text()
    assert second.metrics.previous_recovery_s is not None and second.metrics.deferred_tokens == 0
    assert second.metrics.barrier_wait_s == 0 and second.metrics.previous_pending == 0
    assert answer == second.final.text
    assert [turn.final.token_ids, second.final.token_ids] == _reference(checkpoint)
    assert session.status().turns == 2
    session.close()
    assert worker.runtime.sessions == {}


def test_async_client(embedded):
    _, frontend, _ = embedded

    async def chat() -> tuple[list[str], str, int]:
        async with AsyncClient(frontend.address) as client:
            session = await client.create_session(policy="post_answer", retention=0.5)
            video = [png(64, 64), png(64, 64, "green")]
            kinds = [type(e).__name__ async for e in session.send("what is this ?", images=[png()], videos=[video],
                                                                  max_new_tokens=4, ignore_eos=True)]
            second = await session.send("and the blue one ?", max_new_tokens=3, ignore_eos=True).text()
            turns = (await session.status()).turns
            await session.close()
            return kinds, second, turns

    kinds, second, turns = asyncio.run(chat())
    assert kinds.count("Token") == 4 and kinds[-2:] == ["Metrics", "Final"] and "RecoveryProgress" in kinds
    assert isinstance(second, str) and turns == 2


def test_health_and_reflection_on_every_server(embedded):
    _, frontend, worker = embedded
    for address, service in [(frontend.address, "raincheck.v1.ChatService"),
                             (worker.address, "raincheck.v1.DecodeWorker")]:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(reflection.ServerReflectionInfo(iter([request]), timeout=5))
            names = {s.name for s in reply.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_worker_stats(embedded):
    cluster, frontend, worker = embedded
    session = cluster.client(frontend).create_session()
    with grpc.insecure_channel(worker.address) as channel:
        stats = worker_pb2_grpc.DecodeWorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
    assert (stats.worker_id, stats.sessions, stats.active_turns, stats.total_pages) == (worker.worker_id, 1, 0, 512)
    assert stats.free_pages == 512 and stats.recovery_modes == [chat_pb2.RECOVERY_MODE_COLOCATED]
    session.close()
