"""Qwen3.5's multi-token-prediction head built from transformers' own layers, as the demo trains it.

transformers has no MTP module (it drops `mtp.*` on load), so this one assembles it from the family's
classes under the checkpoint's names below `mtp.`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`
(2d -> d over [embedding ‖ hidden]), one full-attention decoder layer, `norm`. The engine's head
(raincheck_core/models/mtp.py) is tested against it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class TransformersMtp(nn.Module):
    """Over `[B, T]` rows: `hidden` the target's final-norm hidden state at each row, `embeds` the
    embedding of the token after it; returns the head's output after `norm` (the LM head reads it)."""

    def __init__(self, text_config, moe: bool = False):
        super().__init__()
        if moe:
            from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
            norm, layer, rotary = m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeTextRotaryEmbedding
        else:
            from transformers.models.qwen3_5 import modeling_qwen3_5 as m
            norm, layer, rotary = m.Qwen3_5RMSNorm, m.Qwen3_5DecoderLayer, m.Qwen3_5TextRotaryEmbedding
        cfg = copy.deepcopy(text_config)
        cfg.layer_types = ["full_attention"]
        cfg._attn_implementation = "eager"
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = norm(d, eps)
        self.pre_fc_norm_hidden = norm(d, eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([layer(cfg, 0)])
        self.norm = norm(d, eps)
        self.rotary = rotary(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """`embeds`, `hidden` `[B, T, d]`, `positions` `[3, B, T]`; causal over each example's rows, of which
        `mask` `[B, T]` names the real ones (None: all), unless `visible` `[B, T, T]` (True: query row sees
        key row) says otherwise."""
        t = embeds.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        if visible is None:
            visible = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None]
            if mask is not None:
                visible = visible & mask.bool()[:, None, :]
        additive = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(~visible, float("-inf"))
        return self.norm(self.layers[0](x, self.rotary(x, positions), attention_mask=additive[:, None]))

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The weights as a checkpoint stores them: under `mtp.`, Qwen3.5-MoE's experts one tensor each."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("rotary."):
                continue
            if name.endswith("experts.gate_up_proj"):
                stem, half = name[:-len("gate_up_proj")], t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"mtp.{stem}{e}.gate_proj.weight"] = t[e, :half]
                    out[f"mtp.{stem}{e}.up_proj.weight"] = t[e, half:]
            elif name.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    out[f"mtp.{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
            else:
                out[f"mtp.{name}"] = t
        return {k: v.detach().contiguous() for k, v in out.items()}
