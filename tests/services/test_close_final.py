"""CloseSession is final: a turn streaming when its session closes is cancelled, and its relay's attempt to
log it afterwards brings nothing back (Redis keys, images, quota entries)."""

from __future__ import annotations

import time

from raincheck_client import Final, NotFound, Token
from tests.multimodal.mm_helpers import png
from tests.services.conftest import redis_store


def _left(store, session_id: str) -> list[str]:
    """The session's keys, and any image or quota key (every earlier session of the test is closed)."""
    keys = [k.decode()[len(store.prefix):] for k in store.redis.scan_iter(match=f"{store.prefix}*")]
    return sorted(k for k in keys if session_id in k or k.startswith(("blob", "owner")))


def test_close_during_a_stream_leaves_no_keys(cluster, redis_prefix):
    store = redis_store(redis_prefix)
    cluster.worker(redis_store(redis_prefix))
    frontend = cluster.frontend(redis_store(redis_prefix), api_keys=("alice",))
    client = cluster.client(frontend, "alice")
    for attempt in range(3):            # the relay's log lands before or after the close: either way
        session = client.create_session()
        session.send("what is this ?", images=[png(color=["red", "green", "blue"][attempt])],
                     max_new_tokens=3, ignore_eos=True).text()
        assert f"session:{session.id}:blobs" in _left(store, session.id)
        assert any(k.startswith("blob:") for k in _left(store, session.id))
        stream = iter(session.send("and the blue one ?", max_new_tokens=400, ignore_eos=True))
        assert isinstance(next(stream), Token)
        session.close()
        rest = list(stream)
        assert isinstance(rest[-1], Final) and rest[-1].finish_reason == "cancelled"
        time.sleep(0.2)                 # whatever the relay still writes, it has written by now
        assert _left(store, session.id) == [f"session:{session.id}"]
        assert 0 < store.redis.pttl(f"{store.prefix}session:{session.id}") <= store.closed_ttl_ms
        try:
            session.send("hi").text()
            raise AssertionError("a closed session took a turn")
        except NotFound as e:
            assert "is closed" in str(e)
