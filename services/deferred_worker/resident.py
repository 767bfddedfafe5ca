"""Session-resident context: what a deferred worker keeps of a session between its recoveries, so that
the decode worker ships only what it lacks.

After a recovery the actor keeps the context it prefilled on (each row's position in the session's
cache, its K/V) and its own result. The next request for the session names the copy it relies on (its
`epoch`, a lineage the decode worker starts with every full shipment, and its `digest`) and says which of
the result's rows the decode worker joined and where (`adopt`: the others were restored by fused chunks,
and come again as context); the actor puts the held rows, the adopted ones and the shipped ones
together in cache order, checks that they are as many as the residual sees, and prefills. A copy that is
missing (evicted, a new or restarted actor) or another than the one named is never used: the request is
answered with a miss, and the decode worker ships everything again.

The digest chains, per recovery, fingerprints of the bytes that built the copy: the rows adopted and the
rows shipped, as both sides hold them on the wire. The decode worker computes the same chain, so a copy
whose digest matches holds exactly what the decode worker believes it does.

Copies live within a memory budget, least recently used first out; a session's copy is dropped when the
session closes (`forget`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from raincheck_core.deferral.handoff import ResidualPayload

from .messages import PrefillRequest
from .wire import unpack_tensor


def fingerprint(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a))
    return h.hexdigest()


def chain(previous: str, ticket: int, adopted: str, shipped: str) -> str:
    """The digest of a copy: the one it grew from, the recovery's ticket, what was adopted and shipped."""
    return hashlib.blake2b(f"{previous}|{ticket}|{adopted}|{shipped}".encode(), digest_size=16).hexdigest()


def shipped_fingerprint(packed_payload: dict) -> str:
    return fingerprint(packed_payload["context_index"][1], packed_payload["context_k"][1],
                       packed_payload["context_v"][1])


def adopted_fingerprint(packed_result: dict, offset: int, positions: np.ndarray) -> str:
    return fingerprint(positions, packed_result["k"][1][:, offset:], packed_result["v"][1][:, offset:])


@dataclass
class Entry:
    epoch: str
    digest: str
    index: torch.Tensor              # positions in the session's cache of the rows held, ascending
    k: torch.Tensor                  # [attn layers, rows, kv heads, head dim]
    v: torch.Tensor
    result: dict | None              # the last recovery's packed result, until the next request places it

    def nbytes(self) -> int:
        rows = sum(self.result[name][1].nbytes for name in ("k", "v")) if self.result else 0
        return self.k.numel() * self.k.element_size() * 2 + self.index.numel() * 8 + rows


class Miss(Exception):
    """The request relies on a copy this actor does not hold (`reason`: none, stale)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ResidentContexts:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())

    def context(self, request: PrefillRequest, payload: ResidualPayload) -> tuple[ResidualPayload, str]:
        """The payload (`request`'s, unpacked) with its whole context, and the digest of the copy it makes.
        Miss when the request relies on a copy that is not here."""
        shipped = shipped_fingerprint(request.payload)
        base = request.base
        if base is None:
            return payload, chain("", request.ticket, "", shipped)
        entry = self.entries.get(request.session)
        if entry is None:
            raise Miss("none")
        if (entry.epoch, entry.digest) != (base.epoch, base.digest):
            raise Miss("stale")
        parts = [(entry.index, entry.k, entry.v)]
        adopted = ""
        adopt = request.adopt
        if adopt is not None:
            if entry.result is None:
                raise Miss("stale")
            offset, positions = adopt.offset, adopt.positions
            adopted = adopted_fingerprint(entry.result, offset, positions)
            k, v = (unpack_tensor(entry.result[name], entry.k.device)[:, offset:] for name in ("k", "v"))
            parts.append((torch.from_numpy(np.array(positions)), k, v))
        parts.append((payload.context_index, payload.context_k, payload.context_v))
        index = torch.cat([p[0] for p in parts])
        if len(index) != payload.visible or index.unique().numel() != len(index):
            raise Miss("stale")
        order = index.argsort()
        full = replace(payload, context_index=index[order], context_k=torch.cat([p[1] for p in parts], 1)[:, order],
                       context_v=torch.cat([p[2] for p in parts], 1)[:, order])
        return full, chain(entry.digest, request.ticket, adopted, shipped)

    def keep(self, session: str, entry: Entry) -> bool:
        """Hold `entry` for the session (most recently used), evicting others past the budget. False when
        it alone exceeds the budget (nothing is kept for the session)."""
        self.entries.pop(session, None)
        if entry.nbytes() > self.budget:
            return False
        self.entries[session] = entry
        while self.nbytes > self.budget:
            self.entries.popitem(last=False)
            self.evictions += 1
        return True

    def forget(self, session: str) -> None:
        self.entries.pop(session, None)
