"""The shapes the device script runs: random decoders at real models' text shapes, built on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raincheck_core import Engine, EngineConfig, ModelConfig, Prompt, VisualInput
from raincheck_core.models import build_decoder
from raincheck_core.models.random_init import build_config

# the text decoders of Qwen3-VL-8B and Qwen3.5-9B (their config.json text sections); the vision towers are
# not built: images arrive as precomputed embeddings
LARGE = {
    "qwen3-vl-8b": ("qwen3_vl", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151936)),
    "qwen3.5-9b": ("qwen3_5", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128,
                                   layer_types=["linear_attention"] * 3 * 8)),
}


@dataclass(frozen=True)
class Shape:
    name: str
    family: str
    hf_config: object          # transformers' config (for the transformers timing)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.hf_config.to_dict())


def shapes(tiny: bool) -> list[Shape]:
    if tiny:
        return [Shape(f"tiny-{f}", f, build_config(f, "tiny")) for f in ("qwen3_vl", "qwen3_5")]
    out = []
    for name, (family, text) in LARGE.items():
        cfg = build_config(family, "tiny")
        text = dict(text)
        if family == "qwen3_5":     # three GDN layers, then one full-attention layer, eight times
            text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 8
            text["rope_parameters"] = dict(cfg.text_config.rope_parameters, mrope_section=[11, 11, 10])
        else:
            text["rope_parameters"] = dict(cfg.text_config.rope_parameters, mrope_section=[24, 20, 20])
        for key, value in text.items():
            setattr(cfg.text_config, key, value)
        ids = dict(image_token_id=text["vocab_size"] - 9, vision_start_token_id=text["vocab_size"] - 7,
                   vision_end_token_id=text["vocab_size"] - 6, video_token_id=text["vocab_size"] - 8)
        for key, value in ids.items():
            setattr(cfg, key, value)
        cfg.vision_config.out_hidden_size = text["hidden_size"]
        out.append(Shape(name, family, cfg))
    return out


def random_engine(shape: Shape, device: str, dtype: str, **options) -> Engine:
    """A decoder of `shape` with random weights, built on `device` (nothing is read from disk)."""
    cfg = shape.model_config
    with torch.device(device):
        model = build_decoder(cfg)
    model = model.to(dtype=EngineConfig(dtype=dtype).torch_dtype)
    with torch.no_grad():        # small weights: a random model of this depth stays finite in bf16
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return Engine(model, cfg, EngineConfig(device=device, dtype=dtype, max_rows_per_step=8192, deferred_budget=63,
                                           **options))


def transformers_model(shape: Shape, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(shape.hf_config, dtype=dtype)
    return model.eval()


def image_prompt(engine: Engine, visual_tokens: int, text_tokens: int, seed: int = 0) -> Prompt:
    """Half the text, one square image of `visual_tokens` merged tokens (as precomputed embeddings), the
    other half; text ids drawn below the model's multimodal ids."""
    cfg = engine.model_config
    side = math.isqrt(visual_tokens)
    n = side * side
    g = torch.Generator().manual_seed(seed)
    visual = VisualInput("image", torch.randn(n, cfg.hidden_size, generator=g), (1, 2 * side, 2 * side),
                         [torch.randn(n, cfg.hidden_size, generator=g) for _ in range(cfg.deepstack_levels)])
    words = torch.randint(16, min(2000, cfg.vocab_size - 16), (text_tokens,), generator=g).tolist()
    half = text_tokens // 2
    return Prompt([*words[:half], cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id,
                   *words[half:]], [visual])
