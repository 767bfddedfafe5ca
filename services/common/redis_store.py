"""`Store` on Redis, shared by every frontend and decode worker of a deployment (schema: docs/services.md).

Keys, under a prefix P (default `raincheck:`):
  P worker:<id>           hash   a registration (address, model, load); expires unless refreshed
  P workers               set    ids of registered workers (lapsed ones are pruned on read)
  P session:<id>          hash   a session record; expires after the session TTL without a turn
  P session:<id>:turns    list   the turn log, JSON per turn; same expiry
  P blob:<sha256>         string image bytes by content; expires with the sessions that use them
"""

from __future__ import annotations

import json
from dataclasses import asdict

import redis

from .store import SessionRecord, TurnRecord, WorkerInfo, digest


class RedisStore:
    def __init__(self, url: str, prefix: str = "raincheck:", session_ttl_s: float = 86400.0,
                 closed_ttl_s: float = 3600.0):
        self.redis = redis.Redis.from_url(url)
        self.prefix = prefix
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self.closed_ttl_ms = int(closed_ttl_s * 1000)
        self._detach = self.redis.register_script(_DETACH)

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # ------------------------------------------------------------------ workers
    def register_worker(self, info: WorkerInfo, ttl_s: float) -> None:
        fields = {k: json.dumps(v) for k, v in asdict(info).items()}
        key = self._key("worker", info.worker_id)
        with self.redis.pipeline() as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.sadd(self._key("workers"), info.worker_id)
            pipe.execute()

    def remove_worker(self, worker_id: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.delete(self._key("worker", worker_id))
            pipe.srem(self._key("workers"), worker_id)
            pipe.execute()

    def workers(self) -> list[WorkerInfo]:
        ids = sorted(i.decode() for i in self.redis.smembers(self._key("workers")))
        with self.redis.pipeline() as pipe:
            for worker_id in ids:
                pipe.hgetall(self._key("worker", worker_id))
            found = pipe.execute()
        lapsed = [worker_id for worker_id, fields in zip(ids, found, strict=True) if not fields]
        if lapsed:
            self.redis.srem(self._key("workers"), *lapsed)
        return [_worker(fields) for fields in found if fields]

    def worker(self, worker_id: str) -> WorkerInfo | None:
        fields = self.redis.hgetall(self._key("worker", worker_id))
        return _worker(fields) if fields else None

    # ------------------------------------------------------------------ sessions
    def create_session(self, record: SessionRecord) -> None:
        key = self._key("session", record.session_id)
        fields = {k: json.dumps(v) for k, v in asdict(record).items() if k != "turns"}
        with self.redis.pipeline() as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self.session_ttl_ms)
            pipe.execute()

    def session(self, session_id: str) -> SessionRecord | None:
        with self.redis.pipeline() as pipe:
            pipe.hgetall(self._key("session", session_id))
            pipe.llen(self._key("session", session_id, "turns"))
            fields, turns = pipe.execute()
        if not fields:
            return None
        values = {k.decode(): json.loads(v) for k, v in fields.items()}
        return SessionRecord(**values, turns=turns)

    def set_session_worker(self, session_id: str, worker_id: str) -> None:
        key = self._key("session", session_id)
        if self.redis.exists(key):   # never leave a partial record behind an expired one
            self.redis.hset(key, "worker_id", json.dumps(worker_id))

    def detach_session(self, session_id: str, worker_id: str) -> bool:
        return bool(self._detach(keys=[self._key("session", session_id)], args=[json.dumps(worker_id), json.dumps("")]))

    def close_session(self, session_id: str) -> None:
        key = self._key("session", session_id)
        if not self.redis.exists(key):
            return
        with self.redis.pipeline() as pipe:
            pipe.hset(key, "closed", "true")
            pipe.pexpire(key, self.closed_ttl_ms)
            pipe.delete(self._key("session", session_id, "turns"))
            pipe.execute()

    def append_turn(self, session_id: str, turn: TurnRecord) -> int:
        log = self._key("session", session_id, "turns")
        with self.redis.pipeline() as pipe:
            pipe.rpush(log, json.dumps(asdict(turn)))
            pipe.pexpire(log, self.session_ttl_ms)
            pipe.pexpire(self._key("session", session_id), self.session_ttl_ms)
            count, _, _ = pipe.execute()
        return count

    def turns(self, session_id: str) -> list[TurnRecord]:
        entries = self.redis.lrange(self._key("session", session_id, "turns"), 0, -1)
        return [TurnRecord(**json.loads(e)) for e in entries]

    # ------------------------------------------------------------------ blobs
    def put_blob(self, data: bytes) -> str:
        key = digest(data)
        self.redis.set(self._key("blob", key), data, px=self.session_ttl_ms)
        return key

    def blob(self, digest: str) -> bytes | None:
        return self.redis.get(self._key("blob", digest))

    def close(self) -> None:
        self.redis.close()


# Compare-and-set of a session's worker: another frontend may have moved the session meanwhile.
_DETACH = """
if redis.call('HGET', KEYS[1], 'worker_id') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'worker_id', ARGV[2])
  return 1
end
return 0
"""


def _worker(fields: dict[bytes, bytes]) -> WorkerInfo:
    return WorkerInfo(**{k.decode(): json.loads(v) for k, v in fields.items()})

