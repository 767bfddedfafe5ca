"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face `config.json` (nested VLM configs or flat text-only ones);
`EngineConfig` holds the serving knobs. Both are plain dataclasses, validated on construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, InvalidInputError, UnsupportedModelError

# model_type (top level or text config) -> model family implemented in raincheck_core.models
FAMILIES = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_text": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
}


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    mrope_section: tuple[int, int, int]
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Gated DeltaNet (Qwen3.5 linear-attention layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # multimodal
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    spatial_merge_size: int = 2
    deepstack_levels: int = 0
    has_vision: bool = False
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_attention_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_gdn_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        top_type = raw.get("model_type")
        text = raw.get("text_config") or raw
        family = FAMILIES.get(top_type) or FAMILIES.get(text.get("model_type"))
        if family is None:
            raise UnsupportedModelError(
                f"model_type {top_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        try:
            return _parse(family, raw, text)
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the field {e.args[0]!r} needed by {family}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json in {folder}")
        raw = json.loads(path.read_text())
        gen = Path(folder) / "generation_config.json"
        if gen.is_file():
            raw = {**raw, "_generation": json.loads(gen.read_text())}
        return cls.from_dict(raw)


def _parse(family: str, raw: dict, text: dict) -> ModelConfig:
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if family == "qwen3_5":
        theta = 10000.0 if theta is None else theta
        rotary = int(head_dim * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        default_section = (11, 11, 10)
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(text["num_hidden_layers"])
        ]
    else:
        theta = 500000.0 if theta is None else theta
        rotary = head_dim
        default_section = (24, 20, 20)
        layer_types = ["full_attention"] * text["num_hidden_layers"]
    vision = raw.get("vision_config") or {}
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    eos = raw.get("_generation", {}).get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelConfig(
        family=family,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rotary_dim=rotary,
        mrope_section=tuple(rope.get("mrope_section", default_section)),
        layer_types=tuple(layer_types),
        tie_word_embeddings=bool(tie),
        attention_bias=bool(text.get("attention_bias", False)),
        linear_num_key_heads=text.get("linear_num_key_heads", 0),
        linear_num_value_heads=text.get("linear_num_value_heads", 0),
        linear_key_head_dim=text.get("linear_key_head_dim", 0),
        linear_value_head_dim=text.get("linear_value_head_dim", 0),
        linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
        image_token_id=raw.get("image_token_id"),
        video_token_id=raw.get("video_token_id"),
        vision_start_token_id=raw.get("vision_start_token_id"),
        vision_end_token_id=raw.get("vision_end_token_id"),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        deepstack_levels=len(vision.get("deepstack_visual_indexes", [])) if family == "qwen3_vl" else 0,
        has_vision=bool(vision),
        eos_token_ids=eos_ids,
        raw=raw,
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs of one Engine (one device, many sessions)."""

    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 4096            # KV pages in the pool, shared by all sessions
    max_pages_per_session: int = 2048
    max_gdn_slots: int = 64          # sessions with live recurrent state at once
    max_rows_per_step: int = 2048    # the step's row budget (prefill chunking + decode rows)
    deferred_budget: int = 63        # deferred rows per step riding on decode steps (bounds TPOT growth)
    recovery_chunk: int = 256        # rows per prefill-only recovery chunk after an answer
    num_threads: int | None = None   # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("page_size", "num_pages", "max_pages_per_session", "max_gdn_slots", "max_rows_per_step",
                     "deferred_budget", "recovery_chunk"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
