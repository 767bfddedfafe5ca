"""Exactness on the device against transformers: tiny random checkpoints of both families, one image as
precomputed embeddings, each backend, fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import torch

from raincheck_core import Engine, SamplingParams
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.models.random_init import build_model
from raincheck_core.multimodal.turn_input import TurnInput, build_turn_input

from .models import image_prompt

FULL = DeferralConfig("full")
RAINCHECK = DeferralConfig("raincheck", tpot_slo=None, selector="uniform", guard=0, chunk_size=31)
ANSWER = 4


def _inputs(engine: Engine, prompt) -> tuple[TurnInput, TurnInput, TurnInput]:
    """(the turn's rows, I0, D) exactly as the engine builds them."""
    cfg = engine.model_config
    full = build_turn_input(engine.model, cfg, prompt.token_ids, prompt.visuals, 0)
    parts = partition_turn(full, prompt.visuals, RAINCHECK, cfg.spatial_merge_size)
    return full, full.subset(parts.keep_rows), full.subset(parts.deferred_rows)


def _tokens(engine: Engine, ids: list[int], start: int) -> TurnInput:
    """Generated tokens' rows at consecutive positions from `start`."""
    return build_turn_input(engine.model, engine.model_config, ids, [], start)


def _hf_logits(hf, *inputs: TurnInput) -> torch.Tensor:
    """transformers' decoder over the rows of `inputs` one after another; logits `[T, vocab]` fp32."""
    embeds = torch.cat([i.embeds for i in inputs])
    positions = torch.cat([i.positions.to(embeds.device) for i in inputs], dim=1)
    rows, feats, offset = [], [], 0
    for i in inputs:
        if i.deepstack:
            rows.append(i.deepstack_index.to(embeds.device) + offset)
            feats.append(i.deepstack)
        offset += len(i)
    kwargs = {}
    if rows:
        ds_rows = torch.cat(rows)
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
        mask[ds_rows] = True
        order = torch.argsort(ds_rows)
        kwargs = dict(visual_pos_masks=mask[None],
                      deepstack_visual_embeds=[torch.cat(level)[order] for level in zip(*feats, strict=True)])
    with torch.no_grad():
        out = hf.model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None], **kwargs)
        return hf.lm_head(out.last_hidden_state)[0].float()


def _turn(engine: Engine, prompt, cfg: DeferralConfig) -> tuple[list[int], torch.Tensor]:
    session = engine.open_session(deferral=cfg)
    events = session.turn(prompt, SamplingParams(max_new_tokens=ANSWER, ignore_eos=True), return_logits=True).tokens()
    session.close()
    return [e.token_id for e in events], torch.stack([e.logits for e in events])


def reference(family: str, folder: Path) -> torch.nn.Module:
    """transformers' tiny random checkpoint of `family`, saved into `folder` for the engine to load."""
    hf = build_model(family, "tiny")
    hf.save_pretrained(folder)
    return hf


def case(hf: torch.nn.Module, folder: Path, device: str, dtype: str, backend: str) -> dict:
    """{full, raincheck}: the largest |logit - transformers'| of each turn on one backend and dtype."""
    ref = hf.to(device=device, dtype=getattr(torch, dtype))
    engine = Engine.from_pretrained(folder, device=device, dtype=dtype, backend=backend)
    prompt = image_prompt(engine, 16, 8)
    full, i0, d = _inputs(engine, prompt)
    ids, logits = _turn(engine, prompt, FULL)
    want = _hf_logits(ref, full, _tokens(engine, ids[:-1], full.next_position))[len(full) - 1:]
    rc_ids, rc = _turn(engine, prompt, RAINCHECK)
    first = _hf_logits(ref, i0)[-1]
    second = _hf_logits(ref, i0, d, _tokens(engine, rc_ids[:1], i0.next_position))[-1]
    return {"full": float((logits.to(want.device) - want).abs().max()),
            "raincheck": max(float((rc[0].to(first.device) - first).abs().max()),
                             float((rc[1].to(second.device) - second).abs().max()))}
