"""Turns a step's work into one ForwardBatch, runs the decoder, and hands each turn its logits."""

from __future__ import annotations

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..layers.batch import ForwardBatch
from ..models import DecoderLM
from .scheduler import Work


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVPool, gdn: GDNStatePool | None):
        self.model = model
        self.kv = kv
        self.gdn = gdn

    def run(self, work: list[Work]) -> None:
        """Run one step. Requests whose input completes (or that decode) sample their next token."""
        embeds, positions, segments, logit_rows, samplers = [], [], [], [], []
        ds_rows, ds_feats = [], []
        decode_tokens, decode_slots = [], []
        row = 0
        for item in work:
            req, n = item.request, item.rows
            rows_embeds, pos, first = req.next_rows(n)
            if rows_embeds is None:
                decode_tokens.append(req.last_token)
                decode_slots.append(len(embeds))
                rows_embeds = None
            else:
                ds_index = req.input.deepstack_index
                if ds_index.numel():
                    sel = (ds_index >= first) & (ds_index < first + n)
                    if sel.any():
                        ds_rows.append(ds_index[sel] - first + row)
                        ds_feats.append([level[sel] for level in req.input.deepstack])
            embeds.append(rows_embeds)
            positions.append(pos)
            segments.append(req.seq.add_rows(row, n))
            if req.decoding or first + n == len(req.input):
                logit_rows.append(row + n - 1)
                samplers.append(req)
            row += n
        if decode_tokens:
            ids = torch.tensor(decode_tokens, dtype=torch.long, device=self.model.embed_tokens.weight.device)
            for slot, e in zip(decode_slots, self.model.embed_tokens(ids).split(1), strict=True):
                embeds[slot] = e
        batch = ForwardBatch(
            embeds=torch.cat(embeds), positions=torch.cat(positions, dim=1), segments=segments,
            kv=self.kv, gdn=self.gdn,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long),
            deepstack_rows=torch.cat(ds_rows) if ds_rows else None,
            deepstack=[torch.cat(level) for level in zip(*ds_feats, strict=True)] if ds_feats else [],
        )
        with torch.inference_mode():
            logits = self.model(batch)
        for item in work:
            item.request.advance(item.rows)
        for req, row_logits in zip(samplers, logits, strict=True):
            req.on_logits(row_logits)
