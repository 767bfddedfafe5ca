"""Randomly initialised checkpoints in Hugging Face format, built with transformers' own classes.

Tests, benchmarks and the pre-training demo use them: no weights are ever downloaded. Sizes:
`tiny` (hidden 64, for exactness tests) and `bench` (hidden 384, 8 layers: small enough for a CPU,
large enough that matmuls, not Python, dominate).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 160
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151, 152, 153, 154

SIZES = {
    # hidden, layers, attention heads, kv heads, head_dim, GDN key heads, GDN value heads, GDN head dim, vocab
    "tiny": dict(hidden=64, layers=None, heads=4, kv_heads=2, head_dim=None, gdn_k=2, gdn_v=4, gdn_d=16,
                 vocab=VOCAB),
    "bench": dict(hidden=384, layers=8, heads=6, kv_heads=2, head_dim=64, gdn_k=4, gdn_v=8, gdn_d=48,
                  vocab=2048),
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


def build_config(family: str, size: str = "tiny", tie: bool = False):
    from transformers import Qwen3_5Config, Qwen3VLConfig

    s = SIZES[size]
    hidden, vocab = s["hidden"], s["vocab"]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], rms_norm_eps=1e-6,
                  max_position_embeddings=8192)
    if family == "qwen3_vl":
        head_dim = s["head_dim"] or 16
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]}
        text = dict(common, num_hidden_layers=s["layers"] or 3, head_dim=head_dim, rope_parameters=rope)
        return Qwen3VLConfig(text_config=text, vision_config=_vision_config(hidden, [0, 1]),
                             tie_word_embeddings=tie, **_ids(vocab))
    if family == "qwen3_5":
        head_dim = s["head_dim"] or 32
        rot = head_dim // 4
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [rot // 4, rot // 8, rot // 8]}
        text = dict(common, num_hidden_layers=s["layers"] or 4, head_dim=head_dim, rope_parameters=rope,
                    linear_num_key_heads=s["gdn_k"], linear_num_value_heads=s["gdn_v"],
                    linear_key_head_dim=s["gdn_d"], linear_value_head_dim=s["gdn_d"], linear_conv_kernel_dim=4)
        return Qwen3_5Config(text_config=text, vision_config=_vision_config(hidden, None),
                             tie_word_embeddings=tie, **_ids(vocab))
    raise ValueError(f"unknown family {family!r}")


def build_model(family: str, size: str = "tiny", seed: int = 0, tie: bool = False):
    """A random transformers VLM in eval mode. Norm weights are perturbed too: transformers initialises
    them to constants, which would hide a wrong `w` vs `1 + w` convention."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    cls = Qwen3VLForConditionalGeneration if family == "qwen3_vl" else Qwen3_5ForConditionalGeneration
    model = cls(build_config(family, size, tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_random_checkpoint(folder: str | Path, family: str, size: str = "tiny", seed: int = 0) -> Path:
    folder = Path(folder)
    build_model(family, size, seed).save_pretrained(folder, safe_serialization=True)
    return folder
