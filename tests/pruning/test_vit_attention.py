"""Attention-received scores recomputed from a tiny transformers Qwen3-VL vision tower."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from raincheck_core.errors import InvalidInputError
from raincheck_core.pruning import (
    attention_received_scores,
    default_layers,
    install_attention_capture,
    record_attention_received,
)
from tests import tiny

# one image (4x6 patches -> 6 tokens) and one 2-frame video (2x4 patches per frame -> 2 tokens each)
GRID = torch.tensor([[1, 4, 6], [2, 2, 4]])
PATCH_DIM = 3 * 2 * 16 * 16  # channels * temporal_patch_size * patch_size**2


@pytest.fixture(scope="module")
def tower():
    return tiny.build_model("qwen3_vl").model.visual


def _pixels(grid: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(dim=1).sum()), PATCH_DIM, generator=g)


def _reference(tower, pixels: torch.Tensor, grid: torch.Tensor, block: int) -> torch.Tensor:
    """Full softmax per cu_seqlens block, from the q/k the tower's own qkv layer and RoPE produce."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    seen = {}
    attn = tower.blocks[block].attn
    h1 = attn.qkv.register_forward_hook(lambda m, a, out: seen.update(qkv=out))
    h2 = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        tower(pixels, grid_thw=grid)
    h1.remove(), h2.remove()
    n = seen["qkv"].shape[0]
    q, k, _ = seen["qkv"].reshape(n, 3, attn.num_heads, -1).unbind(1)
    q, k = apply_rotary_pos_emb_vision(q, k, *seen["position_embeddings"])
    bounds = seen["cu_seqlens"].tolist()
    scores = []
    for s, e in itertools.pairwise(bounds):
        logits = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * attn.scaling
        scores.append(torch.softmax(logits, dim=-1).mean(dim=(0, 1)))
    return torch.cat(scores).reshape(-1, 4).mean(dim=1)


def test_scores_shape_sum_and_reference(tower) -> None:
    pixels = _pixels(GRID)
    layers = default_layers(tower)
    assert layers == {"middle": 0, "last": 1}
    scores = attention_received_scores(tower, pixels, GRID, chunk=5)  # chunks cut across rows
    n_tokens = [6, 2, 2]  # the image, then the video's two frames (one attention block each)
    for name, block in layers.items():
        s = scores[name]
        assert s.shape == (sum(n_tokens),) and s.dtype == torch.float32
        assert torch.isfinite(s).all() and (s > 0).all()
        # each block's patch scores sum to 1; the merge-group mean divides by 4
        for part in s.split(n_tokens):
            torch.testing.assert_close(part.sum(), torch.tensor(0.25))
        torch.testing.assert_close(s, _reference(tower, pixels, GRID, block), rtol=1e-5, atol=1e-7)


def test_items_do_not_attend_to_each_other(tower) -> None:
    pixels = _pixels(GRID)
    both = attention_received_scores(tower, pixels, GRID)["last"]
    alone = attention_received_scores(tower, pixels[:24], GRID[:1])["last"]
    torch.testing.assert_close(both[:6], alone, rtol=1e-5, atol=1e-7)


def test_output_unchanged_and_nothing_recorded_outside_the_context(tower) -> None:
    pixels = _pixels(GRID, seed=1)
    with torch.no_grad():
        before = tower(pixels, grid_thw=GRID).pooler_output
        with record_attention_received(tower, {"last": -1}) as scores:
            during = tower(pixels, grid_thw=GRID).pooler_output
        after = tower(pixels, grid_thw=GRID).pooler_output
    assert scores["last"].shape == (10,)        # the forward after the context did not append
    assert torch.equal(before, during) and torch.equal(before, after)


def test_recording_is_per_thread(tower) -> None:
    """Thread A records while thread B runs plain and recording forwards on the same tower: each sees
    only its own forwards' scores (the hooks are shared and stateless; the capture is per context)."""
    install_attention_capture(tower)
    hooks = [dict(b.attn._forward_pre_hooks) for b in tower.blocks]
    pixels, image = _pixels(GRID), _pixels(GRID[:1], seed=2)
    a_inside, b_done = threading.Event(), threading.Event()
    seen: dict[str, dict] = {}

    def a() -> None:
        with torch.no_grad(), record_attention_received(tower, {"last": -1}) as scores:
            a_inside.set()
            b_done.wait(timeout=30)
            seen["a_before_own_forward"] = dict(scores)
            tower(pixels, grid_thw=GRID)
        seen["a"] = scores

    def b() -> None:
        a_inside.wait(timeout=30)
        with torch.no_grad():
            tower(image, grid_thw=GRID[:1])                        # plain: lands nowhere
            with record_attention_received(tower, {"first": 0}) as scores:
                tower(image, grid_thw=GRID[:1])
        seen["b"] = scores
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen["a_before_own_forward"] == {}
    assert set(seen["a"]) == {"last"} and seen["a"]["last"].shape == (10,)
    assert set(seen["b"]) == {"first"} and seen["b"]["first"].shape == (6,)
    torch.testing.assert_close(seen["a"]["last"], attention_received_scores(tower, pixels, GRID)["last"])
    assert [dict(b.attn._forward_pre_hooks) for b in tower.blocks] == hooks   # installed once, never changed


def test_bad_layer_index(tower) -> None:
    with pytest.raises(InvalidInputError, match="out of range"):
        attention_received_scores(tower, _pixels(GRID), GRID, {"deep": 7})


def test_qwen3_5_tower() -> None:
    tower = tiny.build_model("qwen3_5").model.visual
    scores = attention_received_scores(tower, _pixels(GRID), GRID)
    assert set(scores) == {"middle", "last"}
    for s in scores.values():
        torch.testing.assert_close(s.split([6, 2, 2])[2].sum(), torch.tensor(0.25))
