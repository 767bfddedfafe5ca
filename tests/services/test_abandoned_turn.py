"""A turn whose stream is abandoned before its final event (the client leaves, or its frontend dies) is
undone on the worker: the session is as before the turn, so the message sent again is answered as if
the abandoned attempt had never run (and the live session keeps matching its turn log)."""

from __future__ import annotations

import time

from raincheck_client import Token


def test_an_abandoned_turn_is_undone(embedded):
    cluster, frontend, worker = embedded
    client = cluster.client(frontend)
    session = client.create_session()
    turn = session.send("what is this ?", max_new_tokens=500, ignore_eos=True)
    assert isinstance(next(iter(turn)), Token)
    turn.cancel()                                          # the client goes away mid-answer
    deadline = time.monotonic() + 10
    while session.status().status == "streaming":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine_session = worker.runtime.sessions[session.id].session
    assert (engine_session.turns, engine_session.cached_tokens) == (0, 0)
    again = session.send("what is this ?", max_new_tokens=6, ignore_eos=True).result().token_ids
    fresh = client.create_session().send("what is this ?", max_new_tokens=6, ignore_eos=True).result().token_ids
    assert again == fresh and engine_session.turns == 1
