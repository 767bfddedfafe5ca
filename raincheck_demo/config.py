"""The demo model's architecture: a Qwen3.5 VLM (vision tower + 3 GDN : 1 gated-attention decoder), ~1.5 M
parameters, and the image processor settings that make one 32×32-px grid cell one visual token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import tokenizer as tk
from .world import CELL

if TYPE_CHECKING:
    from transformers import Qwen3_5Config
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

MIN_PIXELS = 4 * 4 * CELL * CELL       # grids from 4×4 ...
MAX_PIXELS = 16 * 16 * CELL * CELL     # ... to 16×16 cells are not resized

TEXT = dict(
    vocab_size=tk.VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5,
                     "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
    eos_token_id=tk.IM_END, pad_token_id=tk.PAD,
)
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"], num_position_embeddings=144)


def model_config() -> Qwen3_5Config:
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=True,
        image_token_id=tk.IMAGE_PAD, video_token_id=tk.VIDEO_PAD, vision_start_token_id=tk.VISION_START,
        vision_end_token_id=tk.VISION_END, eos_token_id=tk.IM_END, pad_token_id=tk.PAD,
    )


def image_processor() -> Qwen2VLImageProcessorPil:
    """transformers' Qwen2-VL image processor (PIL backend) with the demo's pixel range."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=VISION["patch_size"], temporal_patch_size=2, merge_size=2,
                                    image_mean=[0.5] * 3, image_std=[0.5] * 3, min_pixels=MIN_PIXELS,
                                    max_pixels=MAX_PIXELS)


def save_processor_files(folder: Path) -> None:
    """preprocessor_config.json, generation_config.json and the tokenizer, beside the weights."""
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
           "patch_size": VISION["patch_size"], "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    gen = {"eos_token_id": [tk.IM_END], "pad_token_id": tk.PAD, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tk.save_tokenizer(folder)
