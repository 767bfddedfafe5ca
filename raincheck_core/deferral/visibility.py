"""Which cache slots a row may attend to (docs/mechanism.md §4).

A session's slots carry one label that matters: whether a slot holds a token the *current* turn
generated while its deferred input is still being recovered (GEN). Deferred rows never see GEN:
recovered input must not depend on the model's own output. Everything else — earlier turns, this
turn's I0, deferred chunks already processed — is visible to them; their own chunk causally.
Decode rows see everything.

The engine applies the rule by giving deferred rows a read list without the GEN slots
(`SessionCache.readable`); `deferred_mask` is the same rule as a dense mask, for reference attention.
"""

from __future__ import annotations

import torch


def deferred_visible(generated: torch.Tensor) -> torch.Tensor:
    """Positions (within the session's slots) of the past slots deferred rows may read."""
    return (~generated).nonzero().flatten()


def deferred_mask(generated: torch.Tensor, n: int) -> torch.Tensor:
    """`[n, past + n]` visibility of `n` deferred rows appended after `past = len(generated)` slots,
    where `generated[j]` marks slot j as GEN."""
    past = generated.shape[0]
    visible_past = (~generated)[None, :].expand(n, past)
    own = torch.ones(n, n, dtype=torch.bool, device=generated.device).tril()
    return torch.cat([visible_past, own], dim=1)
