"""The shapes the device script runs: random decoders at real models' text shapes, built on the device."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from raincheck_core import Engine, EngineConfig, ModelConfig, Prompt, VisualInput
from raincheck_core.models import build_decoder
from raincheck_core.models.random_init import build_config
from raincheck_core.speculative.drafter import Drafter

# the text decoders of Qwen3.5-9B and Qwen3-VL-8B (their config.json text sections), in the order the run
# measures them (the one with GDN layers first); the vision towers are not built: images arrive as
# precomputed embeddings
LARGE = {
    "qwen3.5-9b": ("qwen3_5", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128,
                                   layer_types=["linear_attention"] * 3 * 8)),
    "qwen3-vl-8b": ("qwen3_vl", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151936)),
}
# transformers' modules whose GDN functions bind, at import, to fla's kernels when fla imports
GDN_REFERENCE_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                         "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


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
        return [Shape(f"tiny-{f}", f, build_config(f, "tiny")) for f in ("qwen3_5", "qwen3_vl")]
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


def random_engine(shape: Shape, device: str, dtype: str, drafter: Drafter | None = None, **options: Any) -> Engine:
    """A decoder of `shape` with random weights, built on `device` (nothing is read from disk); `drafter`:
    what proposes draft tokens when `options` turn speculation on."""
    cfg = shape.model_config
    with torch.device(device):
        model = build_decoder(cfg)
    model = model.to(dtype=EngineConfig(dtype=dtype).torch_dtype)
    with torch.no_grad():        # small weights: a random model of this depth stays finite in bf16
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return Engine(model, cfg, EngineConfig(device=device, dtype=dtype, max_rows_per_step=8192, deferred_budget=63,
                                           **options), drafter=drafter)


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


class _HideFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "fla" or name.startswith("fla."):
            raise ImportError(f"{name} is hidden while transformers' reference models are imported")


def import_reference_models() -> str:
    """Imports transformers' Qwen3.5 modules with fla hidden, so their delta rule binds to the torch code:
    with fla importable, transformers switches it to fla's Triton kernels, which use TF32 on Hopper, and
    the fp32 reference would carry their error. Returns which implementation the reference's chunked
    delta rule is bound to (a module imported earlier keeps the binding it got then)."""
    loaded = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    finder = _HideFla()
    sys.meta_path.insert(0, finder)
    try:
        dense = importlib.import_module(GDN_REFERENCE_MODULES[0])
        for name in GDN_REFERENCE_MODULES[1:]:
            if importlib.util.find_spec(name) is not None:      # a transformers without the family lacks it
                importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(loaded)
    return bound_implementation(getattr(dense, "torch_chunk_gated_delta_rule", None))


def bound_implementation(fn: object) -> str:
    """The module of the function transformers' kernel wrapper `fn` calls (its `implementation`)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    bound = dict(zip(code.co_freevars, cells, strict=True)) if code else {}
    cell = bound.get("implementation")
    if cell is None:
        return f"unknown ({getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None)})"
    return f"{cell.cell_contents.__module__}.{cell.cell_contents.__qualname__}"
