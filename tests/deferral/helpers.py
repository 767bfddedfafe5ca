"""Shared setup of the deferral tests: an image turn, its I0/D split, and transformers references."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from raincheck_core import Engine, Prompt
from raincheck_core.deferral.gdn_join import GDNJoin
from raincheck_core.deferral.partition import partition_turn
from raincheck_core.deferral.policy import DeferralConfig
from raincheck_core.multimodal.turn_input import TurnInput, build_turn_input
from tests.engine.reference import image_tokens, random_visual

T = TypeVar("T")
GRID = (1, 8, 12)            # 24 visual tokens; at r = 0.3, 8 kept and 16 deferred


def image_prompt(engine: Engine, seed: int = 0, grid: tuple[int, int, int] = GRID) -> Prompt:
    visual = random_visual("image", grid, engine.model_config.hidden_size, engine.model_config.deepstack_levels,
                           seed=seed)
    return Prompt([5, 6, *image_tokens(grid), 7, 8, 9], [visual])


def on_join_release(monkeypatch: pytest.MonkeyPatch, capture: Callable[[GDNJoin], T]) -> list[T]:
    """A list that receives `capture(join)` for each GDN join when its recovery completes (before its
    prefix state is freed)."""
    captured = []
    release = GDNJoin.release

    def spy(self: GDNJoin) -> None:
        if self.prefix is not None:
            captured.append(capture(self))
        release(self)

    monkeypatch.setattr(GDNJoin, "release", spy)
    return captured


def record_prefix_states(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each GDN join's prefix state (conv, ssm) when its recovery completes: the state after I0 ‖ D."""
    return on_join_release(monkeypatch, lambda j: (j.pool.conv[j.prefix].clone(), j.pool.ssm[j.prefix].clone()))


def record_joined_states(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """Each join's S_lead', joined live state and recorded suffix factors when its recovery completes."""
    return on_join_release(monkeypatch, lambda j: (j.s_lead.clone(), j.pool.ssm[j.live].clone(), j.factors))


def two_attention_hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    """A tiny Qwen3.5 (transformers model, saved folder) with a second attention layer after GDN layers:
    the shared tiny one has its only attention layer last, where no later layer reads a deferred row's
    attention output."""
    from transformers import Qwen3_5ForConditionalGeneration

    from raincheck_core.models.random_init import build_config

    cfg = build_config("qwen3_5")
    text = cfg.text_config
    text.num_hidden_layers = 5
    text.layer_types = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                        "full_attention"]
    torch.manual_seed(3)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("qwen3_5_two_attention")
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


def slow_decays(hf, engine: Engine) -> None:
    """Slow GDN decays in both the transformers model and the engine's, so that a missing or wrong join
    shows: the tiny model's own decays take P_rest to zero within a few tokens (test_gdn_join.py)."""
    with torch.no_grad():
        for m in (*[layer.linear_attn for layer in hf.model.language_model.layers
                    if getattr(layer, "block_type", "") == "linear_attention"], *engine.model.gdn_layers()):
            m.A_log.fill_(-4.0)


def split(engine: Engine, prompt: Prompt, cfg: DeferralConfig, start: int = 0) -> tuple[TurnInput, TurnInput]:
    """(I0, D) exactly as the engine builds them."""
    full = build_turn_input(engine.model, engine.model_config, prompt.token_ids, prompt.visuals, start)
    parts = partition_turn(full, prompt.visuals, cfg, engine.model_config.spatial_merge_size)
    return full.subset(parts.keep_rows), full.subset(parts.deferred_rows)


def concat(*inputs: TurnInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Rows of several inputs one after another: embeds, positions, DeepStack rows and features."""
    embeds = torch.cat([i.embeds for i in inputs])
    positions = torch.cat([i.positions for i in inputs], dim=1)
    offset, rows, feats = 0, [], []
    for i in inputs:
        if i.deepstack:
            rows.append(i.deepstack_index + offset)
            feats.append(i.deepstack)
        offset += len(i)
    if not rows:
        return embeds, positions, torch.empty(0, dtype=torch.long), []
    return embeds, positions, torch.cat(rows), [torch.cat(level) for level in zip(*feats, strict=True)]


def token_rows(engine: Engine, ids: list[int], position: int) -> TurnInput:
    """Text rows at consecutive positions from `position` (generated tokens, a later turn); any id is
    text here, even one a random model sampled that happens to be a placeholder id."""
    with torch.no_grad():
        embeds = engine.model.embed_tokens(torch.tensor(ids))
    positions = torch.arange(position, position + len(ids)).expand(3, -1)
    return TurnInput(list(ids), embeds, positions, position + len(ids), None, torch.empty(0, dtype=torch.long), [])


def hf_forward(hf, embeds, positions, ds_rows, ds_feats, cache=None) -> torch.Tensor:
    """transformers' text decoder over the given rows in the given order; logits `[T, vocab]`."""
    lm = hf.model.language_model
    kwargs = {}
    if ds_feats:
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool)
        mask[ds_rows] = True
        order = torch.argsort(ds_rows)       # transformers takes features in row order
        kwargs = dict(visual_pos_masks=mask[None], deepstack_visual_embeds=[f[order] for f in ds_feats])
    with torch.no_grad():
        out = lm(inputs_embeds=embeds[None], position_ids=positions[:, None], past_key_values=cache,
                 use_cache=cache is not None, **kwargs)
        return hf.lm_head(out.last_hidden_state)[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
