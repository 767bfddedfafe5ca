"""An exact reference for turns across a bounded barrier (docs/mechanism.md §10).

The engine's rows are recorded in processing order as its steps plan them (`RowLog`), with their labels.
`reference` runs transformers' decoder layer by layer over them: attention layers through transformers'
own attention with the visibility mask the labels give (a deferred row of turn t sees earlier turns and
its own turn's non-generated rows processed before it; any other row sees everything processed before
it), GDN layers with the layer's own weights row by row (recurrent form): input and generated rows on
the live state, deferred rows of turn t on turn t's prefix state (the live state when t's input ended),
and after each deferred chunk the live state is the token-wise re-application of the recorded suffix
(the pre-conv inputs and gates of every live row since t's boundary, as computed) from the new prefix;
a later turn's prefix state is re-applied the same way up to its own boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from raincheck_core import Engine
from raincheck_core.engine.plan import CHUNKS, Kind, StepPlan
from raincheck_core.engine.resolve import rows_of
from raincheck_core.ops.gdn import causal_conv1d, recurrent_gated_delta_rule, split_qkv


@dataclass
class Row:
    token: int | None               # a generated row's token (embedded by transformers); else `embed`
    embed: torch.Tensor | None
    position: torch.Tensor          # [3]
    deepstack: list[torch.Tensor]   # one feature per level, for visual rows of Qwen3-VL
    turn: int
    generated: bool
    deferred: bool
    sample: bool = False            # the engine sampled a token from this row
    boundary: bool = False          # the last input row of its turn
    join: bool = False              # the last row of a deferred chunk


@dataclass
class RowLog:
    rows: list[Row] = field(default_factory=list)

    def record(self, engine: Engine, plan: StepPlan) -> None:
        for seg in plan.segments:
            if seg.kind in (Kind.RESIDUAL, Kind.HANDOFF):   # a scratch session's rows (a hand-off's prefill),
                continue                                    # or rows a deferred worker ran: not this forward's
            cache = engine.core.cache(seg.session)
            if seg.kind is Kind.DECODE:
                self.rows.append(Row(seg.token, None, torch.full((3,), seg.position), [], cache.latest_turn,
                                     True, False, sample=True))
                continue
            src = rows_of(seg, engine.core)
            deferred = seg.kind in CHUNKS
            turn = cache.recovery.turn if deferred else cache.latest_turn
            for r in range(seg.first, seg.first + seg.rows):
                at = (src.deepstack_index == r).nonzero().flatten()
                feats = [level[at[0]].clone() for level in src.deepstack] if len(at) else []
                self.rows.append(Row(None, src.embeds[r].clone(), src.positions[:, r].clone(), feats, turn, False,
                                     deferred))
            last = self.rows[-1]
            last.sample = seg.sample
            last.boundary = seg.kind is Kind.PREFILL and seg.sample
            last.join = deferred

    def sampled(self, turn: int) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.sample and r.turn == turn]


def mask(rows: list[Row]) -> torch.Tensor:
    n = len(rows)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, r in enumerate(rows):
        for j in range(i + 1):
            o = rows[j]
            out[i, j] = not r.deferred or j == i or o.turn < r.turn or (o.turn == r.turn and not o.generated)
    return out


@dataclass
class Reference:
    logits: torch.Tensor                     # [rows, vocab]
    keys: dict[int, torch.Tensor]            # attention layer index -> [rows, kv heads, d]
    values: dict[int, torch.Tensor]
    live: dict[int, torch.Tensor]            # GDN layer index -> final live state [H, Dk, Dv]


def reference(hf, rows: list[Row]) -> Reference:
    from transformers import DynamicCache

    lm = hf.model.language_model
    with torch.no_grad():
        h = torch.stack([lm.embed_tokens(torch.tensor(r.token)) if r.token is not None else r.embed
                         for r in rows])[None]
        positions = torch.stack([r.position for r in rows], dim=1)[:, None]
        pe = lm.rotary_emb(h, positions)
        additive = torch.zeros(len(rows), len(rows)).masked_fill_(~mask(rows), float("-inf"))[None, None]
        cache = DynamicCache(config=hf.config.get_text_config())
        visual = [i for i, r in enumerate(rows) if r.deepstack]
        live = {}
        for idx, layer in enumerate(lm.layers):
            x = layer.input_layernorm(h)
            if getattr(layer, "block_type", "full_attention") == "linear_attention":
                out, live[idx] = _gdn(layer.linear_attn, x[0], rows)
                out = out[None]
            else:
                out, _ = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=additive,
                                         past_key_values=cache)
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if visual and idx < len(rows[visual[0]].deepstack):
                h = h.clone()
                h[0, visual] += torch.stack([rows[i].deepstack[idx] for i in visual])
        logits = hf.lm_head(lm.norm(h))[0].float()
    attn = [i for i in range(len(lm.layers)) if i not in live]
    return Reference(logits, {i: cache.layers[i].keys[0].transpose(0, 1) for i in attn},
                     {i: cache.layers[i].values[0].transpose(0, 1) for i in attn}, live)


def _gdn(m, x: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """One GDN layer over `x [rows, hidden]`: outputs `[rows, hidden]` and the final live state."""
    n = x.shape[0]
    u = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(n, m.num_v_heads, m.head_v_dim)
    beta = m.in_proj_b(x).sigmoid().float()
    g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias)
    weight = m.conv1d.weight[:, 0]

    def run(idx: list[int], hist: torch.Tensor, state: torch.Tensor):
        conv, hist = causal_conv1d(u[idx], weight, hist)
        q, k, v = split_qkv(conv, m.num_k_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim)
        o, state = recurrent_gated_delta_rule(q, k, v, g[idx], beta[idx], state)
        return o, hist, state

    live = (u.new_zeros(weight.shape[1] - 1, u.shape[1]), torch.zeros(m.num_v_heads, m.head_k_dim, m.head_v_dim))
    prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    suffix: dict[int, list[int]] = {}         # turn -> live rows since its boundary (its recorded suffix)
    behind: dict[int, tuple[int, int]] = {}   # turn -> (earlier turn pending at its boundary, suffix length then)
    o = torch.empty(n, m.num_v_heads, m.head_v_dim)
    for i, r in enumerate(rows):
        if r.deferred:
            o[i:i + 1], *prefix[r.turn] = run([i], *prefix[r.turn])
            if r.join:
                live = _replay(run, prefix[r.turn], suffix[r.turn])
                for later, (ahead, upto) in behind.items():
                    if ahead == r.turn:
                        prefix[later] = _replay(run, prefix[r.turn], suffix[r.turn][:upto])
            continue
        o[i:i + 1], *live = run([i], *live)
        for t in suffix:
            suffix[t].append(i)
        if r.boundary:
            pending = [t for t in suffix if t < r.turn]
            if pending:
                behind[r.turn] = (pending[-1], len(suffix[pending[-1]]))
            prefix[r.turn], suffix[r.turn] = tuple(live), []
    y = m.norm(o.reshape(-1, m.head_v_dim).to(x.dtype), z.reshape(-1, m.head_v_dim))
    return m.out_proj(y.reshape(n, -1)), live[1]


def _replay(run, start: tuple[torch.Tensor, torch.Tensor], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if not idx:
        return start
    _, hist, state = run(idx, *start)
    return hist, state
