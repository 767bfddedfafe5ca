"""What a decode worker and a deferred worker say to each other, typed: `PrefillRequest` (a recovery to
prefill) and `PrefillReply` (its result, or a miss).

On the way they are plain data (`to_wire` / `from_wire`: dicts of strings, numbers and numpy arrays, the
payload and result packed by wire.py), because the decode worker's Ray driver process forwards them
over its channel (JSON and raw arrays, channel.py) and Ray hands them to the actor; both ends build the
typed messages from that. No module here imports torch: the driver reads none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class Base(NamedTuple):
    """The copy of the session's context a request relies on (resident.py): its lineage and digest."""

    epoch: str
    digest: str


class Adopt(NamedTuple):
    """The rows of the copy's last result that the decode worker joined (from `offset` on), and their
    positions in the session's cache (the others were restored by fused chunks, and come again as context)."""

    offset: int
    positions: np.ndarray


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill `payload` (a packed ResidualPayload) of `session`'s recovery `ticket` on the context it ships
    and, with `base`, on the copy of the session's context the actor keeps; with `keep`, the actor keeps
    the context it prefilled on as the copy of lineage `epoch`."""

    session: str
    ticket: int
    payload: dict[str, Any]
    epoch: str = ""
    keep: bool = True
    base: Base | None = None
    adopt: Adopt | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"session": self.session, "ticket": self.ticket, "payload": self.payload,
                "base": None if self.base is None else {"epoch": self.base.epoch, "digest": self.base.digest},
                "adopt": None if self.adopt is None else {"offset": self.adopt.offset,
                                                          "positions": self.adopt.positions},
                "epoch": self.epoch, "keep": self.keep}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> PrefillRequest:
        base, adopt = wire.get("base"), wire.get("adopt")
        return cls(wire["session"], wire["ticket"], wire["payload"], wire.get("epoch", ""), wire.get("keep", True),
                   None if base is None else Base(base["epoch"], base["digest"]),
                   None if adopt is None else Adopt(adopt["offset"], adopt["positions"]))


@dataclass(frozen=True)
class PrefillReply:
    """The actor's answer: the packed ResidualResult, its prefill time, and the digest of the copy it keeps
    now (`kept`: whether it keeps one); or `miss`, why the copy the request relied on is not there (the
    actor: none, stale; the driver: gone, busy). The driver adds the actor that ran it and how long the
    request waited for it."""

    result: dict[str, Any] | None = None
    compute_s: float = 0.0
    digest: str = ""
    kept: bool = False
    miss: str | None = None
    actor: str = ""
    wait_s: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        """The actor's part."""
        if self.miss is not None:
            return {"miss": self.miss}
        return {"result": self.result, "compute_s": self.compute_s, "digest": self.digest, "kept": self.kept}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> PrefillReply:
        """The driver's reply: the actor's part, with `actor` and `wait_s`."""
        return cls(wire.get("result"), wire.get("compute_s", 0.0), wire.get("digest", ""), bool(wire.get("kept")),
                   wire.get("miss"), wire.get("actor", ""), wire.get("wait_s", 0.0))
