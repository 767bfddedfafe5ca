"""Model and engine configuration.

`ModelConfig` is what the engine reads of a checkpoint. It comes from transformers' own config classes
(`AutoConfig` on the folder's config.json), so every field a real checkpoint leaves out takes the value
transformers gives it; `_from_hf` maps those classes to the engine's fields, in this one place.
`EngineConfig` holds the serving knobs. Both are plain dataclasses, validated on construction.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, InvalidInputError, UnsupportedModelError
from .speculative.config import SpeculativeConfig

# model_type (top level or text config) -> model family implemented in raincheck_core.models
FAMILIES = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_text": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
# The M-RoPE split (temporal, height, width) that transformers' modeling code assumes when a config has
# none (Qwen3VLTextRotaryEmbedding, Qwen3_5TextRotaryEmbedding): it is not a config default.
DEFAULT_MROPE_SECTION = {"qwen3_vl": (24, 20, 20), "qwen3_5": (11, 11, 10), "qwen3_vl_moe": (24, 20, 20),
                         "qwen3_5_moe": (11, 11, 10)}


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
    max_position_embeddings: int | None = None   # the context length the checkpoint was built for
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0     # 0: no shared expert
    moe_layers: tuple[int, ...] = ()             # layers whose MLP is the sparse MoE block
    # Qwen3.5's multi-token-prediction head (`mtp.*` tensors, models/mtp.py): how many decoder layers it has
    # (0: the config declares none)
    mtp_layers: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)   # config.json as written

    @property
    def num_attention_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_gdn_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        """From the contents of a config.json (and of a generation_config.json, whose eos_token_id wins)."""
        top_type = raw.get("model_type")
        family = FAMILIES.get(top_type) or FAMILIES.get((raw.get("text_config") or {}).get("model_type"))
        if family is None:
            raise UnsupportedModelError(
                f"model_type {top_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        try:
            # what config_class.from_dict(config.json) builds; on a copy, as it rewrites nested dicts in place
            hf = AutoConfig.for_model(**copy.deepcopy(raw))
        except (StrictDataclassError, TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"config.json is not a valid {top_type} config: {' '.join(str(e).split())}") \
                from None
        return _from_hf(family, hf, raw, (generation or {}).get("eos_token_id"))

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"no config.json in {folder}")
        gen = Path(folder) / "generation_config.json"
        return cls.from_dict(_read_json(path), _read_json(gen) if gen.is_file() else None)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _from_hf(family: str, hf, raw: dict, generation_eos: int | list[int] | None) -> ModelConfig:
    """transformers' config (a VLM's composite config, or a text-only one) -> the engine's ModelConfig.
    Each field reads what transformers' modeling code reads for the same purpose."""
    text = hf.get_text_config(decoder=True)
    rope = dict(text.rope_parameters or {})
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    vision = getattr(hf, "vision_config", None)
    eos = next((e for e in (generation_eos, getattr(text, "eos_token_id", None), getattr(hf, "eos_token_id", None))
                if e is not None), None)
    return ModelConfig(
        family=family,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        # Qwen3.5-MoE's text config has no dense MLP width: every layer is an MoE block
        intermediate_size=getattr(text, "intermediate_size", 0),
        num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        # Qwen3.5 rotates a fraction of each head (0.25 by default); Qwen3-VL the whole head
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        mrope_section=tuple(rope.get("mrope_section", DEFAULT_MROPE_SECTION[family])),
        # Qwen3-VL has no layer_types: every layer is full attention
        layer_types=tuple(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers),
        # the model's own config decides (a VLM's top level, not its text config)
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(text.attention_bias),
        linear_num_key_heads=getattr(text, "linear_num_key_heads", 0),
        linear_num_value_heads=getattr(text, "linear_num_value_heads", 0),
        linear_key_head_dim=getattr(text, "linear_key_head_dim", 0),
        linear_value_head_dim=getattr(text, "linear_value_head_dim", 0),
        linear_conv_kernel=getattr(text, "linear_conv_kernel_dim", 4),
        image_token_id=getattr(hf, "image_token_id", None),
        video_token_id=getattr(hf, "video_token_id", None),
        vision_start_token_id=getattr(hf, "vision_start_token_id", None),
        vision_end_token_id=getattr(hf, "vision_end_token_id", None),
        spatial_merge_size=vision.spatial_merge_size if vision is not None else 2,
        deepstack_levels=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
        has_vision=vision is not None,
        eos_token_ids=_ids(eos),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        num_experts=getattr(text, "num_experts", 0) or 0,
        num_experts_per_tok=getattr(text, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(text, "moe_intermediate_size", 0) or 0,
        shared_expert_intermediate_size=getattr(text, "shared_expert_intermediate_size", 0) or 0,
        moe_layers=_moe_layers(text),
        # not a field of transformers' config classes: it keeps the key as an attribute, as vLLM reads it
        mtp_layers=getattr(text, "mtp_num_hidden_layers", 0) or 0,
        raw=raw,
    )


def _moe_layers(text) -> tuple[int, ...]:
    """The layers transformers builds a sparse MoE block in (Qwen3VLMoeTextDecoderLayer: all but
    `mlp_only_layers`, every `decoder_sparse_step`-th; Qwen3_5MoeDecoderLayer: every layer)."""
    if not getattr(text, "num_experts", 0):
        return ()
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", 1) or 1
    return tuple(i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the op backends a step may run (ops/backend.py `select`): auto (CUDA: FlexAttention with fla's GDN kernels
# where triton imports, and decode steps graph-captured; elsewhere native), or one set by name
BACKENDS = ("auto", "native", "torch", "flex", "fla")


def default_backend() -> str:
    """`EngineConfig.backend` when none is given: the RAINCHECK_BACKEND environment variable, else auto."""
    return os.environ.get("RAINCHECK_BACKEND") or "auto"


def default_tensor_parallel_size() -> int:
    """`EngineConfig.tensor_parallel_size` when none is given: RAINCHECK_TENSOR_PARALLEL_SIZE, else 1."""
    value = os.environ.get("RAINCHECK_TENSOR_PARALLEL_SIZE") or "1"
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"RAINCHECK_TENSOR_PARALLEL_SIZE must be an integer, got {value!r}") from None


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
    max_model_len: int | None = None  # tokens a session may hold; None: the model's max_position_embeddings
    # the prefix cache (cache/prefix.py): full KV pages shared between sessions, at most this many pages
    # held (None: half of num_pages; pages only the cache holds are evicted first when the pool is short),
    # and GDN state checkpoints in a slab of this many bytes, taken at start-up (None: a quarter of the KV
    # pool's bytes, at most 256 MiB)
    prefix_cache: bool = True
    prefix_cache_pages: int | None = None
    gdn_checkpoint_bytes: int | None = None
    gdn_checkpoint_every: int = 256        # slots between GDN checkpoints of a long prompt (rounded to pages)
    encoder_cache_bytes: int = 256 << 20   # vision tower outputs by image content (0: off)
    backend: str = field(default_factory=default_backend)   # one of BACKENDS
    cuda_graphs: bool = True         # on CUDA with a non-native backend: decode steps bucketed and graph-captured
    # plan the next decode step and stage its inputs while a decode step's forward runs (engine/ahead.py;
    # the GPU path's backends): None on where the forward runs beside the host (CUDA); True also on the CPU,
    # where it changes nothing but the order of the host's work (tests, bench.host)
    plan_ahead: bool | None = None
    # tensor parallelism (raincheck_core/parallel): the ranks the decoder's heads, widths and vocabulary are
    # split over (1: one process holds the whole model, nothing else changes), and whether MoE experts are
    # split across them (expert parallelism) rather than each expert's width
    tensor_parallel_size: int = field(default_factory=default_tensor_parallel_size)
    expert_parallel: bool = False
    # speculative decoding (raincheck_core/speculative, docs/mechanism.md §13): off by default
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("tensor_parallel_size", "page_size", "num_pages", "max_pages_per_session", "max_gdn_slots",
                     "max_rows_per_step", "deferred_budget", "recovery_chunk", "gdn_checkpoint_every"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefix_cache_pages is not None and self.prefix_cache_pages <= 0:
            raise InvalidInputError(f"prefix_cache_pages must be positive, got {self.prefix_cache_pages}")
        for name in ("gdn_checkpoint_bytes", "encoder_cache_bytes"):
            if (getattr(self, name) or 0) < 0:
                raise InvalidInputError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.backend not in BACKENDS:
            raise InvalidInputError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise InvalidInputError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
