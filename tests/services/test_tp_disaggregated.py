"""A hand-off between tensor-parallel groups through Ray: a decode worker at TP = 2 ships a turn's
post-answer remainder (every rank's heads, merged) to a deferred-worker actor that loads the same model
at TP = 2 (its own worker rank started inside the actor), and joins its result: the answers are TP = 1's."""

from __future__ import annotations

from services.common.settings import DeferredSettings
from services.common.store import MemoryStore
from tests.services.test_disaggregated import chat
from tests.services.test_tp_serve import rank_pids


def test_a_handoff_between_tp2_groups_through_ray_gives_tp1s_answers(cluster, ray_address, ray_namespace):
    store = MemoryStore()
    single = cluster.worker(store)
    _, first, second = chat(cluster.client(cluster.frontend(store)), "colocated")
    want = [first, second()]
    cluster.stop(single)

    store = MemoryStore()
    worker = cluster.worker(store, recovery_modes=("colocated", "disaggregated"), engine={"tensor_parallel_size": 2},
                            deferred=DeferredSettings(ray_address=ray_address, namespace=ray_namespace, num_cpus=0))
    assert worker.runtime.engine.model.tp.world == 2
    session, first, second = chat(cluster.client(cluster.frontend(store)), "disaggregated")
    assert session.status().pending_deferred_tokens == 0
    assert [first, second()] == want
    (actor,) = worker.runtime.backends["disaggregated"].bridge.stats()["actors"]
    assert actor["calls"] == 1                      # the remainder was prefilled by the actor, not locally
    assert len(rank_pids(actor["pid"])) == 1        # ... at TP = 2: the actor's engine started a worker rank
