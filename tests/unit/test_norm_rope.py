"""The decode step's cheaper forms of the norms and the rotation (layers/norm.py, ops/rope.py,
layers/attention.py) give the bits of the forms they replaced: transformers' rounding order holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raincheck_core.config import ModelConfig
from raincheck_core.layers.attention import Attention
from raincheck_core.layers.norm import OffsetRMSNorm, RMSNorm, normalize
from raincheck_core.ops.rope import apply_rope, inverse_frequencies, mrope_axes, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 384), (7, 384), (3, 8, 64), (33, 2048)])
def test_normalize_is_torchs_rms_norm_bit_for_bit(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    for scale in (1e-20, 1e-3, 1.0, 1e4):
        x = (torch.randn(*shape, generator=gen) * scale).to(dtype)
        wide = torch.randn(shape[0], 3 * shape[-1], generator=gen)[:, :shape[-1]].to(dtype)   # strided rows
        for t in (x, wide):
            with torch.inference_mode():
                assert torch.equal(normalize(t, 1e-6), F.rms_norm(t.float(), (t.shape[-1],), eps=1e-6))


def _rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, rd: int) -> torch.Tensor:
    """The rotation as transformers writes it: cat(-x2, x1) against the plain sin."""
    inv_freq = inverse_frequencies(rd, 10000.0)
    angle = (positions.float()[:, None] * inv_freq[None, :])
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    rotated = torch.cat((-rot[..., rd // 2:], rot[..., :rd // 2]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


@pytest.mark.parametrize("rd", [64, 16])     # the whole head (Qwen3-VL) and a quarter of it (Qwen3.5)
def test_rope_with_sign_folded_sin_matches_rotate_half(rd):
    gen = torch.Generator().manual_seed(rd)
    positions = torch.randint(0, 40_000, (9,), generator=gen)
    x = torch.randn(9, 8, 64, generator=gen)
    cos, sin = rope_cos_sin(positions.expand(3, -1), inverse_frequencies(rd, 10000.0), mrope_axes(rd, (0, 0, 0)),
                            torch.float32)
    assert torch.equal(apply_rope(x, cos, sin), _rotate_half_rope(x, positions, rd))


@pytest.mark.parametrize("norm_cls", [RMSNorm, OffsetRMSNorm])
def test_q_and_k_heads_normalized_together_match_their_own_norms(norm_cls):
    cfg = ModelConfig(family="qwen3_vl", vocab_size=32, hidden_size=96, intermediate_size=64, num_layers=1,
                      num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rotary_dim=16, mrope_section=(0, 0, 0), layer_types=("full_attention",),
                      tie_word_embeddings=False)
    attn = Attention(cfg, 0, norm_cls, gated=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.randn(16, generator=gen))
        attn.k_norm.weight.copy_(torch.randn(16, generator=gen))
    qk = torch.randn(5, 8, 16, generator=gen)
    with torch.inference_mode():
        together = attn.norm_heads(qk)
        assert torch.equal(together[:, :6], attn.q_norm(qk[:, :6]))
        assert torch.equal(together[:, 6:], attn.k_norm(qk[:, 6:]))
    with torch.no_grad():           # a weight loaded in place afterwards is read, not a stale copy
        attn.k_norm.weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(attn.norm_heads(qk)[:, 6:], attn.k_norm(qk[:, 6:]))
