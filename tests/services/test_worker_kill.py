"""A decode worker process killed (SIGKILL, no drain) between turns 2 and 3 of `raincheck` sessions: the
frontend finds it unreachable, rebuilds each session on the surviving worker from its turn log, and
turn 3 is answered right, from a cache holding every past image whole (the demo model's dialogues,
greedy). It equals the no-fault run's answer wherever that one is right: tests/services/test_rebuild.py
says why a `raincheck` cache may miss an item where the rebuilt one, prefilled whole, does not."""

from __future__ import annotations

import random
import subprocess
import sys
import time

from raincheck_demo.world import make_dialogue
from tests.demo.helpers import FOLDER, needs_checkpoint
from tests.services.conftest import MODEL, REDIS_URL, redis_store
from tests.services.test_rebuild import TEST_SEED, _send

ROOT = FOLDER.parents[1]


@needs_checkpoint
def test_turn_after_a_worker_is_killed_equals_the_no_fault_run(cluster, redis_prefix, tmp_path):
    rng = random.Random(TEST_SEED)
    dialogues = [make_dialogue(rng, turns=3, later={"relation": 1.0, "list": 0.5}) for _ in range(2)]
    frontend = cluster.frontend(redis_store(redis_prefix))
    client = cluster.client(frontend)
    cluster.checkpoint = FOLDER
    first = cluster.worker(redis_store(redis_prefix))
    expected = []
    for d in dialogues:
        session = client.create_session(policy="raincheck")
        expected.append([_send(session, d, t) for t in range(3)])
        session.close()
    cluster.stop(first)

    log = tmp_path / "doomed.log"
    command = [sys.executable, "-m", "services.cli", "--plain-logs", "decode-worker", "--redis-url", REDIS_URL,
               "--store-prefix", redis_prefix, "--model", str(FOLDER), "--model-name", MODEL, "--port", "0",
               "--worker-id", "doomed",
               "--metrics-port", "-1"]
    with log.open("w") as out:
        doomed = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        store = redis_store(redis_prefix)
        deadline = time.monotonic() + 60
        while store.worker("doomed") is None:
            assert doomed.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        sessions = [client.create_session(policy="raincheck") for _ in dialogues]
        history = [[_send(s, d, t) for t in range(2)] for s, d in zip(sessions, dialogues, strict=True)]
        standby = cluster.worker(redis_store(redis_prefix))
        doomed.kill()
        doomed.wait()
        answers = [_send(s, d, 2) for s, d in zip(sessions, dialogues, strict=True)]
    finally:
        if doomed.poll() is None:
            doomed.kill()
    assert all(s.info.worker_id == "doomed" for s in sessions)
    assert all(s.status().worker_id == standby.worker_id for s in sessions)
    assert history == [e[:2] for e in expected]
    for d, answer, e in zip(dialogues, answers, expected, strict=True):
        gold = d.questions[2].answer
        assert answer == gold, d.questions[2].text
        assert answer == e[2] or e[2] != gold
