"""Checkpoint layouts: text-only Qwen3.5 (Qwen3_5ForCausalLM), sharded safetensors, tied embeddings."""

from __future__ import annotations

import pytest
import torch

from raincheck_core import Engine
from tests import tiny
from tests.engine.reference import hf_logits


def test_text_only_qwen3_5_causal_lm(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny.build_config("qwen3_5").text_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine.from_pretrained(tmp_path)
    assert engine.vision is None and engine.model_config.family == "qwen3_5"
    ids = torch.randint(0, 150, (29,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    assert float((engine.forward_logits(ids) - ref).abs().max()) <= 1e-4


def test_sharded_checkpoint_with_tied_embeddings(tmp_path):
    model = tiny.build_model("qwen3_vl", seed=4, tie=True)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = Engine.from_pretrained(tmp_path)
    assert engine.model.lm_head.weight.data_ptr() == engine.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 150, (21,), generator=torch.Generator().manual_seed(5))
    assert float((engine.forward_logits(ids) - hf_logits(model, ids)).abs().max()) <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_bfloat16_engine_stays_close_to_fp32(tiny_checkpoints, family):
    _, folder = tiny_checkpoints[family]
    ids = torch.randint(0, 150, (40,), generator=torch.Generator().manual_seed(6))
    fp32 = Engine.from_pretrained(folder).forward_logits(ids)
    bf16 = Engine.from_pretrained(folder, dtype="bfloat16").forward_logits(ids)
    assert bf16.dtype == torch.float32
    assert float((bf16 - fp32).abs().max()) < 0.1 * float(fp32.abs().max())


def test_a_checkpoints_calibrated_selector_options_are_the_sessions_defaults(tmp_path, monkeypatch):
    """`selector_options.json` in the folder: a turn naming that selector without options runs with the
    calibrated ones; explicit options and other selectors are left as they are."""
    from raincheck_core import DeferralConfig, Prompt
    from raincheck_core.engine import session as session_module
    from raincheck_core.pruning.settings import save_selector_options

    folder = tiny.save_model(tiny.build_model("qwen3_5"), tmp_path)
    save_selector_options(folder, {"hiprune": {"object_layer": "last", "deep_layer": "middle"}})
    engine = Engine.from_pretrained(folder)
    calibrated = engine.deferral_for(DeferralConfig("hard", selector="hiprune"))
    assert calibrated.selector_options == {"object_layer": "last", "deep_layer": "middle"}
    explicit = DeferralConfig("hard", selector="hiprune", selector_options={"alpha": 0.2})
    assert engine.deferral_for(explicit) is explicit
    other = DeferralConfig("hard", selector="divprune")
    assert engine.deferral_for(other) is other

    seen = []
    real = session_module.partition_turn
    monkeypatch.setattr(session_module, "partition_turn", lambda full, visuals, cfg, merge: (
        seen.append(cfg), real(full, visuals, cfg, merge))[1])
    session = engine.open_session(deferral=DeferralConfig("hard", selector="hiprune"))
    list(session.turn(Prompt([5, 6, 7]), None))
    assert seen[-1].selector_options == {"object_layer": "last", "deep_layer": "middle"}
    assert session.deferral.selector_options == {}      # the session's own config is not rewritten
