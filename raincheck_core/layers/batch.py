"""One forward pass: stacked rows of one or more sequences and what each row may see.

Linear layers run once over all rows; attention and GDN layers walk the segments (one sequence's
contiguous rows each), so a step can mix prefill chunks and decode rows of many sessions — and,
later, a session's deferred chunk next to its own decode row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool


@dataclass
class Segment:
    """Contiguous rows `[start, end)` of one sequence.

    `write_slots`: KV slots that receive these rows' K/V. `read_slots`: every slot the rows may attend
    to, own slots included, or None when the rows see only themselves, causally (a first prefill: the
    fast path, no gather). `mask` `[n, len(read_slots)]` (True = visible); None = all read slots.
    `gdn_slot`: the GDN state slot these rows read and advance (None for models without GDN).
    `gdn_hook(layer, u, beta, g, k, v)`: called by each GDN layer after these rows ran (deferred
    recovery bookkeeping: the join after a deferred chunk, the lead / P_rest update after a decode row).
    """

    start: int
    end: int
    write_slots: torch.Tensor
    read_slots: torch.Tensor | slice | None
    mask: torch.Tensor | None = None
    gdn_slot: int | None = None
    gdn_hook: Callable[..., None] | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class ForwardBatch:
    embeds: torch.Tensor                     # [R, hidden]
    positions: torch.Tensor                  # [3, R]
    segments: list[Segment]
    kv: KVPool | None
    gdn: GDNStatePool | None
    logit_rows: torch.Tensor | None = None   # rows whose logits are needed; None = all
    deepstack_rows: torch.Tensor | None = None          # visual rows that receive DeepStack features
    deepstack: list[torch.Tensor] = field(default_factory=list)   # per level, [len(deepstack_rows), hidden]
    cos: torch.Tensor | None = None          # filled by the model once per step
    sin: torch.Tensor | None = None


def causal_mask(past: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[n, past + n]`: every row sees the whole past and its own chunk causally."""
    cols = torch.arange(past + n, device=device)
    rows = torch.arange(n, device=device)[:, None]
    return cols[None, :] <= past + rows
