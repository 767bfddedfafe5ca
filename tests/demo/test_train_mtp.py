"""The MTP head's training (raincheck_demo/train_mtp.py) and the head it shipped in demo-v2.

The chained passes run as the drafter chains the head: pass p at row r equals observing rows 0..r-p (those
the head may see) and then chaining p rows, each on the head's own output of the row before, computed from
scratch."""

from __future__ import annotations

import json

import torch

from raincheck_demo.mtp import TransformersMtp
from raincheck_demo.train_mtp import chained_passes
from tests import tiny

from .helpers import V2, needs_v2


def test_chained_passes_are_the_drafters_chain():
    torch.manual_seed(0)
    text = tiny.build_config("qwen3_5").text_config
    head = TransformersMtp(text).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.1 * torch.randn_like(p) if p.dim() == 1 else 0.15 * torch.randn_like(p))
    b, n, d = 2, 14, text.hidden_size
    embeds, hidden = torch.randn(b, n, d), torch.randn(b, n, d)
    positions = torch.arange(n).repeat(3, b, 1)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, 11:] = 0                                  # the second example is shorter
    mask[0, 2:4] = 0                                  # rows the head does not see (deferred visual rows)
    rows = torch.zeros(b, n, dtype=torch.bool)
    rows[0, 6:10] = True
    rows[1, [4, 5, 9]] = True
    depth = 3
    with torch.no_grad():
        passes = chained_passes(head, embeds, hidden, positions, mask, rows, depth)
        compared = [0] * depth
        for p, (g, at, real) in enumerate(passes):
            for i in range(b):
                for j in range(at.shape[1]):
                    r = int(at[i, j])
                    if not (real[i, j] and rows[i, r]):
                        continue
                    seen = mask[i, :r - p + 1].bool()      # observed rows only, at their own positions
                    e, h = embeds[i, :r - p + 1][seen], hidden[i, :r - p + 1][seen]
                    q = positions[:, i, :r - p + 1][:, seen]
                    out = head(e[None], h[None], q[:, None])[0, -1]
                    for x in range(r - p + 1, r + 1):        # chain rows, each from scratch
                        e, h = torch.cat([e, embeds[i, x:x + 1]]), torch.cat([h, out[None]])
                        q = torch.cat([q, positions[:, i, x:x + 1]], 1)
                        out = head(e[None], h[None], q[:, None])[0, -1]
                    torch.testing.assert_close(g[i, j], out, atol=1e-5, rtol=0)
                    compared[p] += 1
    assert compared == [int(rows.sum())] * depth


@needs_v2
def test_the_shipped_head_drafts_what_the_target_says():
    """demo-v2 ships a trained MTP head: it loads into the engine's drafter, and on held-out dialogues
    (two per family) most of its first drafts are the target's next token; a chained second draft is right
    less often than the first."""
    from raincheck_demo.mtp_acceptance import measure

    assert json.loads((V2 / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    acceptance = measure(V2, per_family=2, seed=3, progress=False)
    assert acceptance["k=1"]["acceptance"] > 0.5
    assert acceptance["k=2"]["acceptance"] < acceptance["k=1"]["acceptance"]
