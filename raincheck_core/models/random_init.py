"""Randomly initialised checkpoints in Hugging Face format, built with transformers' own classes.

Tests, benchmarks and the pre-training demo use them: no weights are ever downloaded. Sizes:
`tiny` (hidden 64, for exactness tests) and `bench` (hidden 384, 8 layers: small enough for a CPU,
large enough that matmuls, not Python, dominate). The MoE families (`qwen3_vl_moe`, `qwen3_5_moe`)
take their dense family's shapes with the MLP of `MOE_SHAPES`: odd expert counts, top-k > 1, a shared
expert in Qwen3.5-MoE and, in Qwen3-VL-MoE, one dense layer (`mlp_only_layers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

VOCAB = 160
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151, 152, 153, 154

SIZES = {
    # hidden, layers, attention heads, kv heads, head_dim, GDN key heads, GDN value heads, GDN head dim, vocab
    "tiny": dict(hidden=64, layers=None, heads=4, kv_heads=2, head_dim=None, gdn_k=2, gdn_v=4, gdn_d=16,
                 vocab=VOCAB),
    "bench": dict(hidden=384, layers=8, heads=6, kv_heads=2, head_dim=64, gdn_k=4, gdn_v=8, gdn_d=48,
                  vocab=2048),
}


# experts, top-k, expert width, shared expert width (Qwen3.5-MoE), dense layers (Qwen3-VL-MoE)
MOE_SHAPES = {
    "tiny": dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                 mlp_only_layers=[1]),
    # Qwen3-30B-A3B's proportions at the bench width: 1/16 of the experts active, each 1/2.7 of hidden
    "bench": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=144,
                  shared_expert_intermediate_size=384, mlp_only_layers=[]),
}
ROUTER_SCALE, EXPERT_SCALE = 50.0, 5.0
MOE_FAMILIES = {"qwen3_vl_moe": "qwen3_vl", "qwen3_5_moe": "qwen3_5"}
# family -> transformers' (config class, model class)
CLASSES = {
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}


def _vision_config(out_hidden: int, deepstack: list[int] | None) -> dict:
    cfg = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
               temporal_patch_size=2, out_hidden_size=out_hidden, num_position_embeddings=64)
    if deepstack is not None:
        cfg["deepstack_visual_indexes"] = deepstack
    return cfg


def _ids(vocab: int) -> dict:
    # the four multimodal ids sit just below the top of the vocabulary, whatever its size
    base = vocab - 9
    return dict(image_token_id=base, video_token_id=base + 1, vision_start_token_id=base + 2,
                vision_end_token_id=base + 3)


def build_config(family: str, size: str = "tiny", tie: bool = False, moe: dict | None = None) -> PretrainedConfig:
    """transformers' config of a random checkpoint; `moe` overrides entries of the MoE shape."""
    import transformers

    base = MOE_FAMILIES.get(family, family)
    s = SIZES[size]
    hidden, vocab = s["hidden"], s["vocab"]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], rms_norm_eps=1e-6,
                  max_position_embeddings=8192)
    if base == "qwen3_vl":
        head_dim = s["head_dim"] or 16
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]}
        text = dict(common, num_hidden_layers=s["layers"] or 3, head_dim=head_dim, rope_parameters=rope)
        vision = _vision_config(hidden, [0, 1])
    elif base == "qwen3_5":
        head_dim = s["head_dim"] or 32
        rot = head_dim // 4
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [rot // 4, rot // 8, rot // 8]}
        text = dict(common, num_hidden_layers=s["layers"] or 4, head_dim=head_dim, rope_parameters=rope,
                    linear_num_key_heads=s["gdn_k"], linear_num_value_heads=s["gdn_v"],
                    linear_key_head_dim=s["gdn_d"], linear_value_head_dim=s["gdn_d"], linear_conv_kernel_dim=4)
        vision = _vision_config(hidden, None)
    else:
        raise ValueError(f"unknown family {family!r}")
    if family in MOE_FAMILIES:
        shape = dict(MOE_SHAPES[size], **(moe or {}))
        # Qwen3-VL-MoE has no shared expert; Qwen3.5-MoE no dense layers (nor a dense MLP width)
        shape.pop("shared_expert_intermediate_size" if base == "qwen3_vl" else "mlp_only_layers")
        if base == "qwen3_5":
            text.pop("intermediate_size")
        text.update(shape)
    cls = getattr(transformers, CLASSES[family][0])
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_ids(vocab))


def build_model(family: str, size: str = "tiny", seed: int = 0, tie: bool = False, moe: dict | None = None
                ) -> PreTrainedModel:
    """A random transformers VLM in eval mode. Norm weights are perturbed too: transformers initialises
    them to constants, which would hide a wrong `w` vs `1 + w` convention. MoE routers and experts are
    scaled up: at transformers' init the router's probabilities are near uniform and the experts'
    output small next to the residual, which would hide a wrong top-k, weighting or expert."""
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[family][1])
    model = cls(build_config(family, size, tie, moe))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
            elif ".mlp.experts." in name or ".mlp.shared_expert" in name:
                p.mul_(EXPERT_SCALE)
    return model.eval()


def save_random_checkpoint(folder: str | Path, family: str, size: str = "tiny", seed: int = 0) -> Path:
    folder = Path(folder)
    build_model(family, size, seed).save_pretrained(folder, safe_serialization=True)
    return folder
