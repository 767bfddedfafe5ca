"""Stored responses of the Responses API (`/v1/responses`), for `previous_response_id`, retrieval and deletion.

A stored response is its body as it was returned, its owner (the API key's id: only it can read, continue or
delete it), and the conversation after it, chat-shaped (the input it was given, then its output), with each
image named by its sha256 and its bytes a blob of the store (`Store.put_blob`). A conversation continued with
`previous_response_id` is that conversation and the new input: matched to sessions like any chat, so it
continues the session that answered it. The images of a session's turns are the session's blobs (kept while it
lives); those of a response that ran outside a session (a tool chat) lapse as unclaimed blobs do (10 min).

Records expire with the sessions (the store's session TTL). In Redis they live under the store's prefix
(`P http:response:<id>`); with the in-process store, in this process, at most `MAX_MEMORY_RESPONSES` of them
(the oldest go first).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ..common.redis_store import RedisStore
from ..common.store import Store
from .index import beside

MAX_MEMORY_RESPONSES = 10_000


@dataclass
class StoredResponse:
    id: str
    owner: str                             # the API key's id ("" without auth)
    body: dict                             # the response as returned
    messages: list[dict]                   # the conversation after it (chat messages, images by sha256)
    instructions: str | None = None        # the system message it was given (not in `messages`)
    input_items: list[dict] = field(default_factory=list)   # its input as given (images by sha256)


class ResponseStore(Protocol):
    def put(self, response: StoredResponse) -> None: ...

    def get(self, response_id: str) -> StoredResponse | None: ...

    def delete(self, response_id: str) -> bool: ...


class MemoryResponses:
    def __init__(self, ttl_s: float, limit: int = MAX_MEMORY_RESPONSES):
        self.ttl_s = ttl_s
        self.limit = limit
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()

    def put(self, response: StoredResponse) -> None:
        with self._lock:
            self._items[response.id] = (response, time.monotonic() + self.ttl_s)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._items.get(response_id)
            return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._items.pop(response_id, None)
            return entry is not None and entry[1] > time.monotonic()


class RedisResponses:
    def __init__(self, store: RedisStore):
        self.redis = store.redis
        self.prefix = store.prefix + "http:response:"
        self.ttl_ms = store.session_ttl_ms

    def put(self, response: StoredResponse) -> None:
        self.redis.set(self.prefix + response.id, json.dumps(asdict(response)), px=self.ttl_ms)

    def get(self, response_id: str) -> StoredResponse | None:
        raw = self.redis.get(self.prefix + response_id)
        return StoredResponse(**json.loads(raw)) if raw else None

    def delete(self, response_id: str) -> bool:
        return bool(self.redis.delete(self.prefix + response_id))


def make_responses(store: Store) -> ResponseStore:
    """The response records beside `store`."""
    return beside(store, lambda s: MemoryResponses(s.session_ttl_s), RedisResponses)
