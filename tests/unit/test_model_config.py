"""ModelConfig from checkpoint folders whose config.json transformers' own config classes wrote (with their
defaults for everything not given), at the shapes of real checkpoints: every field the engine reads is
checked against the value the checkpoint means, written out here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5TextConfig, Qwen3VLConfig, Qwen3VLMoeConfig

from raincheck_core import CheckpointError, ModelConfig, UnsupportedModelError

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"raw"}
QWEN35_LAYERS = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(32))
QWEN35_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel=4)
QWEN35_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                  vision_end_token_id=248054)
DENSE = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0,
             moe_layers=())
QWEN3VL_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                   vision_end_token_id=151653)


def _save(config, folder: Path, eos: list[int] | None = None) -> Path:
    config.save_pretrained(folder)
    if eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def _check(config: ModelConfig, expected: dict) -> None:
    assert set(expected) == FIELDS, f"not checked: {sorted(FIELDS - set(expected))}"
    got = {name: getattr(config, name) for name in expected}
    assert got == expected


def test_qwen3_vl_8b(tmp_path):
    text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    vision = dict(out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24])
    folder = _save(Qwen3VLConfig(text_config=text, vision_config=vision), tmp_path, eos=[151645, 151643])
    _check(ModelConfig.from_folder(folder), dict(
        family="qwen3_vl", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=5e6, rotary_dim=128,
        mrope_section=(24, 20, 20), layer_types=("full_attention",) * 36, tie_word_embeddings=False,
        attention_bias=False, linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
        linear_value_head_dim=0, linear_conv_kernel=4, **QWEN3VL_IDS, spatial_merge_size=2, deepstack_levels=3,
        has_vision=True, eos_token_ids=(151645, 151643), max_position_embeddings=262144, mtp_layers=0, **DENSE))


def test_qwen3_vl_defaults_and_the_modeling_code_mrope_default(tmp_path):
    """Nothing given: transformers' defaults, and the M-RoPE split its modeling code assumes."""
    c = ModelConfig.from_folder(_save(Qwen3VLConfig(), tmp_path))
    assert (c.rope_theta, c.mrope_section, c.num_layers, c.num_kv_heads, c.intermediate_size) == \
        (500000.0, (24, 20, 20), 32, 32, 22016)
    assert c.eos_token_ids == () and c.deepstack_levels == 3


def test_qwen3_5_9b(tmp_path):
    text = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                max_position_embeddings=262144, mtp_num_hidden_layers=1)   # as the released config declares
    folder = _save(Qwen3_5Config(text_config=text, vision_config=dict(out_hidden_size=4096)), tmp_path,
                   eos=[248046, 248044])
    _check(ModelConfig.from_folder(folder), dict(
        family="qwen3_5", vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32,
        num_heads=16, num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, rotary_dim=64,
        mrope_section=(11, 11, 10), layer_types=QWEN35_LAYERS, tie_word_embeddings=False, attention_bias=False,
        **QWEN35_GDN, **QWEN35_IDS, spatial_merge_size=2, deepstack_levels=0, has_vision=True,
        eos_token_ids=(248046, 248044), max_position_embeddings=262144, mtp_layers=1, **DENSE))


def test_qwen3_5_small_tied_with_defaults(tmp_path):
    """A small tied checkpoint: rope left to transformers (partial rotary 0.25, theta 1e4, code's M-RoPE
    split), eos from the text config, tie from the model's (top-level) config."""
    text = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                num_key_value_heads=2, eos_token_id=248044)
    c = ModelConfig.from_folder(_save(Qwen3_5Config(text_config=text, tie_word_embeddings=True), tmp_path))
    assert (c.tie_word_embeddings, c.rotary_dim, c.rope_theta, c.mrope_section) == (True, 64, 10000.0, (11, 11, 10))
    assert (c.num_gdn_layers, c.num_attention_layers, c.eos_token_ids) == (18, 6, (248044,))


def test_qwen3_vl_30b_a3b(tmp_path):
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[])
    c = ModelConfig.from_folder(_save(Qwen3VLMoeConfig(text_config=text), tmp_path))
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size) == \
        ("qwen3_vl_moe", 128, 8, 768, 6144)
    assert c.moe_layers == tuple(range(48)) and c.shared_expert_intermediate_size == 0 and c.deepstack_levels == 3


def test_qwen3_vl_moe_dense_layers(tmp_path):
    text = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert ModelConfig.from_folder(_save(Qwen3VLMoeConfig(text_config=text), tmp_path)).moe_layers == (1, 5)


def test_qwen3_5_moe_defaults(tmp_path):
    """Every layer sparse, with a shared expert; the text config has no dense MLP width."""
    c = ModelConfig.from_folder(_save(Qwen3_5MoeConfig(), tmp_path))
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.intermediate_size) == ("qwen3_5_moe", 256, 8, 512, 512, 0)
    assert c.moe_layers == tuple(range(c.num_layers)) and c.num_gdn_layers == 3 * c.num_attention_layers


def test_qwen3_5_text_only(tmp_path):
    c = ModelConfig.from_folder(_save(Qwen3_5TextConfig(), tmp_path))
    assert (c.family, c.has_vision, c.image_token_id, c.deepstack_levels, c.layer_types) == \
        ("qwen3_5", False, None, 0, QWEN35_LAYERS)


def test_a_config_written_the_older_way(tmp_path):
    """Published Qwen3-VL configs keep rope_theta and rope_scaling in the text config; transformers turns
    them into rope_parameters."""
    raw = {"model_type": "qwen3_vl", "image_token_id": 151655, "text_config": {
        "model_type": "qwen3_vl_text", "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "rope_theta": 5000000,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
        "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = ModelConfig.from_folder(tmp_path)
    assert (c.rope_theta, c.mrope_section, c.tie_word_embeddings, c.num_kv_heads, c.image_token_id) == \
        (5e6, (24, 20, 20), True, 8, 151655)
    assert c.raw == raw


@pytest.mark.parametrize(("raw", "error", "match"), [
    ({"model_type": "llava", "text_config": {"model_type": "llama"}}, UnsupportedModelError, "'llava' is not"),
    ({"model_type": "qwen3_5", "text_config": {"hidden_size": "wide"}}, CheckpointError, "hidden_size"),
    ({"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 3, "layer_types": ["full_attention"]}},
     CheckpointError, "layer_types"),
])
def test_bad_configs(tmp_path, raw, error, match):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(error, match=match):
        ModelConfig.from_folder(tmp_path)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        ModelConfig.from_folder(tmp_path)
