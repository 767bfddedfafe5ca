"""Errors of the GDN state join and of the ways to get it wrong (docs/mechanism.md §5).

One Gated DeltaNet layer whose inputs do not depend on context (pre-conv inputs, gates and the conv
weight are fixed random tensors), so "the truth" is exact: the state after running prefix ‖ D ‖ Y
token by token. The decode path ran prefix ‖ Y; recovery then prefills D from the prefix state and
joins. Relative Frobenius errors of the final state against the truth, fp32 unless named:

    python -m bench.gdn_hazards                      # Qwen3.5-9B layer shape: 32 heads of 128x128
    python -m bench.gdn_hazards --heads 8 --dim 48   # the bench model's layer shape

Columns: the join as the engine does it (boundary repair, P on the left); no correction at all; the
join without the boundary repair (P over the whole answer, ΔS of the prefix); the two wrong
orientations (ΔS·P, Pᵀ·ΔS); P rounded to bf16 after every token.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from raincheck_core.ops.gdn import causal_conv1d, l2norm, recurrent_gated_delta_rule
from raincheck_core.ops.gdn_state_map import extend_map, identity_map, join_state

KERNEL = 4
LEAD = KERNEL - 1


class Layer:
    """Random fixed inputs of one GDN layer: H heads of d x d, per-head decay regimes α ≈ 0.8 … 0.9999,
    keys of low effective rank on every other head (rarely written key directions keep P large)."""

    def __init__(self, heads: int, dim: int, seed: int):
        self.h, self.d = heads, dim
        self.gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(3 * heads * dim, KERNEL, generator=self.gen) / math.sqrt(KERNEL)
        slow = torch.logspace(math.log10(0.2), -4, heads)          # 1 - α per head
        self.log_alpha = torch.log1p(-slow)
        spectrum = torch.ones(heads, dim)
        spectrum[1::2] = torch.exp(-torch.arange(dim) / 4.0)         # anisotropic keys on odd heads
        self.key_scale = spectrum.reshape(-1)

    def tokens(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Pre-conv inputs x [n, 3Hd], log decays g [n, H], betas [n, H]."""
        x = torch.randn(n, 3 * self.h * self.d, generator=self.gen)
        x[:, self.h * self.d: 2 * self.h * self.d] *= self.key_scale
        g = self.log_alpha * (0.5 + torch.rand(n, self.h, generator=self.gen))
        beta = torch.sigmoid(torch.randn(n, self.h, generator=self.gen))
        return x, g, beta

    def factors(self, x: Tensor, history: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q, k, v, new conv history) as a GDN layer derives them from its pre-conv inputs."""
        u, history = causal_conv1d(x, self.weight, history)
        q, k, v = F.silu(u).view(len(x), 3, self.h, self.d).unbind(1)
        return l2norm(q) * self.d ** -0.5, l2norm(k), v, history

    def run(self, x: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, history: Tensor | None
            ) -> tuple[Tensor, Tensor, Tensor]:
        """(state, conv history, keys) after running the tokens token by token."""
        q, k, v, history = self.factors(x, history)
        _, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return state, history, k


def _rel(a: Tensor, truth: Tensor) -> float:
    return ((a - truth).norm() / truth.norm()).item()


def measure(layer: Layer, prefix: int, deferred: int, n: int) -> dict[str, float]:
    (xp, gp, bp), (xd, gd, bd), (xy, gy, by) = (layer.tokens(m) for m in (prefix, deferred, n))
    s_ins, hist_ins, _ = layer.run(xp, gp, bp, None, None)
    # the truth: everything in logical order I0 ‖ D ‖ Y
    s_d, hist_d, _ = layer.run(xd, gd, bd, s_ins, hist_ins)
    truth, _, _ = layer.run(xy, gy, by, s_d, hist_d)
    # the decode path: Y right after I0; the lead (first K-1 answer tokens) and P_rest of the others
    s_lead, hist_lead, _ = layer.run(xy[:LEAD], gy[:LEAD], by[:LEAD], s_ins, hist_ins)
    s_live, _, k_rest = layer.run(xy[LEAD:], gy[LEAD:], by[LEAD:], s_lead, hist_lead)
    p_rest = extend_map(identity_map(layer.h, layer.d), k_rest, gy[LEAD:], by[LEAD:])
    p_bf16 = identity_map(layer.h, layer.d)
    for t in range(len(k_rest)):
        p_bf16 = extend_map(p_bf16, k_rest[t:t + 1], gy[LEAD + t:LEAD + t + 1], by[LEAD + t:LEAD + t + 1])
        p_bf16 = p_bf16.bfloat16().float()
    # recovery: D from the prefix state, then the lead again from the new boundary (boundary repair)
    s_lead_new, _, _ = layer.run(xy[:LEAD], gy[:LEAD], by[:LEAD], s_d, hist_d)
    delta = s_lead_new - s_lead
    _, _, k_all = layer.run(xy, gy, by, s_ins, hist_ins)
    p_all = extend_map(identity_map(layer.h, layer.d), k_all, gy, by)
    return {
        "join": _rel(join_state(s_live, p_rest, delta), truth),
        "no correction": _rel(s_live, truth),
        "no boundary repair": _rel(join_state(s_live, p_all, s_d - s_ins), truth),
        "ΔS·P": _rel(s_live + delta @ p_rest, truth),
        "Pᵀ·ΔS": _rel(s_live + p_rest.mT @ delta, truth),
        "P in bf16": _rel(join_state(s_live, p_bf16, delta), truth),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--deferred", type=int, default=256)
    parser.add_argument("--suffix", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [(n, measure(Layer(args.heads, args.dim, seed=n), args.prefix, args.deferred, n)) for n in args.suffix]
    names = list(rows[0][1])
    print(f"{args.heads} heads x {args.dim}x{args.dim}, prefix {args.prefix}, D {args.deferred}, conv kernel "
          f"{KERNEL}; relative error of the final state against prefix ‖ D ‖ Y run token by token")
    print("| answer tokens n | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for n, errs in rows:
        print(f"| {n} | " + " | ".join(f"{errs[k]:.1e}" for k in names) + " |")


if __name__ == "__main__":
    main()
