"""Which cache slots a deferred row may attend to (docs/mechanism.md §4, §10).

Every slot carries two labels, set when it is claimed: the session turn whose processing wrote it, and
whether it holds a token that turn generated (GEN). A deferred row of turn `t` sees a slot written by an
earlier turn, or by turn `t` itself and not GEN (its I0, its earlier chunks): never its own answer, and
never anything of a later turn (the previous answer's tail fed with the follow-up, the follow-up's input
and answer), which only exists when the follow-up did not wait for `t`'s rows (a bounded barrier). Its
own chunk it sees causally. Decode and input rows see everything.

The engine applies the rule by giving deferred rows a read list of the visible slots
(`SessionCache.deferred_readable`); `deferred_mask` is the same rule as a dense mask, for reference attention.
"""

from __future__ import annotations

import numpy as np
import torch

Labels = torch.Tensor | np.ndarray


def visible_to(turns: Labels, generated: Labels, turn: int) -> Labels:
    """Per slot (labels `turns`, `generated`, tensors or the session cache's numpy arrays): may a deferred row
    of turn `turn` read it."""
    return (turns < turn) | ((turns == turn) & ~generated)


def deferred_mask(turns: torch.Tensor, generated: torch.Tensor, turn: int, n: int) -> torch.Tensor:
    """`[n, past + n]` visibility of `n` deferred rows of `turn` appended after `past = len(turns)` labelled
    slots."""
    past = turns.shape[0]
    visible_past = visible_to(turns, generated, turn)[None, :].expand(n, past)
    own = torch.ones(n, n, dtype=torch.bool, device=turns.device).tril()
    return torch.cat([visible_past, own], dim=1)
