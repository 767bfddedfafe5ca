"""`Store` on Redis, shared by every frontend and decode worker of a deployment (schema: docs/services.md).

Keys, under a prefix P (default `raincheck:`):
  P worker:<id>           hash   a registration (address, model, load); expires unless refreshed
  P workers               set    ids of registered workers (lapsed ones are pruned on read)
  P session:<id>          hash   a session record; expires after the session TTL without a turn
  P session:<id>:turns    list   the turn log, JSON per turn; same expiry
  P session:<id>:blobs    set    digests of the images its logged turns name; same expiry
  P blob:<sha256>         string image bytes by content; expires with the sessions that use them
  P blob:<sha256>:sessions set   ids of the sessions whose logged turns name it; same expiry
  P owner:<key id>:sessions  zset  its open sessions, scored by when they expire (ms since the epoch)
  P owner:<key id>:turns     zset  its running turns, scored by when their lease lapses

Logging a turn and closing a session are Lua scripts, so that a turn logged after the close (a relay
racing CloseSession) is refused instead of bringing the keys back, and closing drops the images no
other session has logged. The scripts name keys from the prefix: one Redis, not a Redis Cluster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict

import redis

from .store import QuotaError, SessionRecord, TurnRecord, WorkerInfo, digest


class RedisStore:
    def __init__(self, url: str, prefix: str = "raincheck:", session_ttl_s: float = 86400.0,
                 closed_ttl_s: float = 3600.0, unclaimed_blob_ttl_s: float = 600.0):
        self.redis = redis.Redis.from_url(url)
        self.prefix = prefix
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self.closed_ttl_ms = int(closed_ttl_s * 1000)
        self.unclaimed_blob_ttl_ms = int(unclaimed_blob_ttl_s * 1000)
        self._detach = self.redis.register_script(_DETACH)
        self._set_worker = self.redis.register_script(_SET_WORKER)
        self._append = self.redis.register_script(_APPEND)
        self._close = self.redis.register_script(_CLOSE)
        self._create = self.redis.register_script(_CREATE)
        self._begin_turn = self.redis.register_script(_BEGIN_TURN)

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
    def create_session(self, record: SessionRecord, limit: int | None = None) -> None:
        fields = [x for k, v in asdict(record).items() if k != "turns" for x in (k, json.dumps(v))]
        created = self._create(keys=[self._key("session", record.session_id), self._key("owner", record.owner,
                                                                                          "sessions")],
                               args=[_now_ms(), self.session_ttl_ms, -1 if limit is None else limit,
                                     record.session_id, *fields])
        if not created:
            raise QuotaError(f"this API key has {limit} open sessions, the limit: close one first")

    def open_sessions(self, owner: str) -> int:
        key = self._key("owner", owner, "sessions")
        return self.redis.zcount(key, f"({_now_ms()}", "+inf")

    def begin_turn(self, owner: str, turn_id: str, limit: int, lease_s: float) -> None:
        if not self._begin_turn(keys=[self._key("owner", owner, "turns")],
                                args=[_now_ms(), int(lease_s * 1000), limit, turn_id]):
            raise QuotaError(f"this API key has {limit} turns running, the limit: wait for one to end")

    def end_turn(self, owner: str, turn_id: str) -> None:
        self.redis.zrem(self._key("owner", owner, "turns"), turn_id)

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
        # never on a closed or expired record (no partial record either)
        self._set_worker(keys=[self._key("session", session_id)], args=[json.dumps(worker_id)])

    def detach_session(self, session_id: str, worker_id: str) -> bool:
        return bool(self._detach(keys=[self._key("session", session_id)], args=[json.dumps(worker_id), json.dumps("")]))

    def close_session(self, session_id: str) -> None:
        self._close(keys=self._session_keys(session_id), args=[self.closed_ttl_ms, session_id, self.prefix])

    def append_turn(self, session_id: str, turn: TurnRecord, blobs: Mapping[str, bytes] | None = None) -> int:
        names = list(dict.fromkeys([*turn.images, *(frame for video in turn.videos for frame in video)]))
        blobs = blobs or {}
        data = [blobs.get(name, b"") for name in names]
        return self._append(keys=self._session_keys(session_id), args=[
            json.dumps(asdict(turn)), self.session_ttl_ms, session_id, self.prefix, len(names), *names, *data,
            _now_ms() + self.session_ttl_ms])

    def _session_keys(self, session_id: str) -> list[str]:
        return [self._key("session", session_id), self._key("session", session_id, "turns"),
                self._key("session", session_id, "blobs")]

    def turns(self, session_id: str) -> list[TurnRecord]:
        entries = self.redis.lrange(self._key("session", session_id, "turns"), 0, -1)
        return [TurnRecord(**json.loads(e)) for e in entries]

    # ------------------------------------------------------------------ blobs
    def put_blob(self, data: bytes) -> str:
        key = digest(data)
        name = self._key("blob", key)
        # unclaimed until a logged turn names it; one stored already (same bytes) keeps the longer expiry
        if not self.redis.set(name, data, px=self.unclaimed_blob_ttl_ms, nx=True):
            self.redis.pexpire(name, self.unclaimed_blob_ttl_ms, gt=True)
        return key

    def blob(self, digest: str) -> bytes | None:
        return self.redis.get(self._key("blob", digest))

    def close(self) -> None:
        self.redis.close()


# Compare-and-set of a session's worker: another frontend may have moved the session meanwhile.
_DETACH = """
if redis.call('HGET', KEYS[1], 'closed') ~= 'true' and redis.call('HGET', KEYS[1], 'worker_id') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'worker_id', ARGV[2])
  return 1
end
return 0
"""

_SET_WORKER = """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HGET', KEYS[1], 'closed') ~= 'true' then
  redis.call('HSET', KEYS[1], 'worker_id', ARGV[1])
end
"""

# KEYS: session, its turns, its blobs set. ARGV: turn JSON, TTL ms, session id, prefix, n, n digests, n blobs
# (b"": already stored), the new expiry (ms since the epoch). Refused (0) for a closed or expired session:
# nothing is written.
_APPEND = """
local session, turns, owned = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', session) == 0 or redis.call('HGET', session, 'closed') == 'true' then return 0 end
local ttl, id, prefix, n = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
for i = 1, n do
  local blob = prefix .. 'blob:' .. ARGV[5 + i]
  if ARGV[5 + n + i] ~= '' then redis.call('SET', blob, ARGV[5 + n + i]) end
  redis.call('SADD', blob .. ':sessions', id)
  redis.call('SADD', owned, ARGV[5 + i])
end
for _, digest in ipairs(redis.call('SMEMBERS', owned)) do   -- the session's images live as long as it does
  redis.call('PEXPIRE', prefix .. 'blob:' .. digest, ttl)
  redis.call('PEXPIRE', prefix .. 'blob:' .. digest .. ':sessions', ttl)
end
local count = redis.call('RPUSH', turns, ARGV[1])
for _, key in ipairs({session, turns, owned}) do redis.call('PEXPIRE', key, ttl) end
local quota = prefix .. 'owner:' .. cjson.decode(redis.call('HGET', session, 'owner')) .. ':sessions'
redis.call('ZADD', quota, ARGV[6 + 2 * n], id)   -- its open-session entry expires with it
redis.call('PEXPIRE', quota, ttl)
return count
"""

# KEYS as _APPEND. ARGV: closed TTL ms, session id, prefix. The record stays (closed) for the closed TTL;
# the turn log goes, and each image no other session's log names.
_CLOSE = """
local session, turns, owned = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', session) == 0 then return 0 end
redis.call('HSET', session, 'closed', 'true')
redis.call('PEXPIRE', session, ARGV[1])
redis.call('ZREM', ARGV[3] .. 'owner:' .. cjson.decode(redis.call('HGET', session, 'owner')) .. ':sessions', ARGV[2])
for _, digest in ipairs(redis.call('SMEMBERS', owned)) do
  local claims = ARGV[3] .. 'blob:' .. digest .. ':sessions'
  redis.call('SREM', claims, ARGV[2])
  if redis.call('SCARD', claims) == 0 then redis.call('DEL', ARGV[3] .. 'blob:' .. digest) end
end
redis.call('DEL', turns, owned)
return 1
"""


# KEYS: the session record, its owner's open sessions. ARGV: now ms, TTL ms, limit (-1: none), session id,
# then the record's fields and values. 0 (nothing written) when the owner is at the limit.
_CREATE = """
local now, ttl, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if limit >= 0 and redis.call('ZCARD', KEYS[2]) >= limit then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
redis.call('PEXPIRE', KEYS[2], ttl)
return 1
"""

# KEYS: the owner's running turns. ARGV: now ms, lease ms, limit, turn id.
_BEGIN_TURN = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _worker(fields: dict[bytes, bytes]) -> WorkerInfo:
    return WorkerInfo(**{k.decode(): json.loads(v) for k, v in fields.items()})

