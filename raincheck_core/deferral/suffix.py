"""The factors of a follow-up's input rows, for a previous turn's GDN join still pending (docs/mechanism.md
§10.3).

A follow-up admitted past a bounded barrier prefills its input on the live state while the previous
turn's deferred rows are still out: those rows belong to that join's recorded suffix, like the answer's
tokens, so their transitions extend its `P_rest` (and, after an answer shorter than the conv lead, the
first of them complete the lead). A multi-row sequence's kernel keeps no per-row k or state, so they are
recomputed here from the rows' pre-conv inputs, `g` and `beta`, starting from the live conv history and
state before the step: the same convolution and delta rule the layer ran, by the GDN ops handed in
(`GDNOps.replay`, ops/backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.backend import GDNOps


@dataclass
class InputFactors:
    """One sequence's rows, every layer's: `[rows, layers, ...]` (k per key head); `states` only for the
    first `lead` rows (the state after each)."""

    u: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    states: torch.Tensor | None


def input_factors(layers: list, u: list[torch.Tensor], g: list[torch.Tensor], beta: list[torch.Tensor],
                  conv: torch.Tensor, ssm: torch.Tensor, lead: int, gdn_ops: GDNOps) -> InputFactors:
    """`u, g, beta`: per GDN layer (`layers`, the model's token mixers in order) the rows' pre-conv inputs
    `[T, C]` and gates `[T, H]`; `conv [layers, K-1, C]`, `ssm [layers, H, Dk, Dv]`: the live history and
    state the rows started from; `lead`: how many first rows need the state after them; `gdn_ops`: the
    step's GDN ops."""
    ks, vs, states = [], [], []
    for i, layer in enumerate(layers):   # under the caller's inference mode: the weights need no graph
        run = gdn_ops.replay(u[i], g[i], beta[i], layer.conv1d.weight[:, 0], conv[i], ssm[i], layer.hk, lead)
        ks.append(run.k)        # per key head, as decode rows hand k over
        vs.append(run.v)
        if lead:
            states.append(run.states)
    def rows(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts, dim=1)
    return InputFactors(rows(u), rows(ks), rows(vs), rows(g), rows(beta), rows(states) if lead else None)
