"""MoE checkpoints beyond the shared tiny ones: top-1 routing, the Hub's transposed expert layout,
sharded and tied checkpoints, text-only MoE models, and the errors of a checkpoint that does not fit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from raincheck_core import Engine, Prompt, SamplingParams
from raincheck_core.errors import CheckpointError
from raincheck_core.ops import backend
from raincheck_core.ops.moe import grouped_experts, grouped_mm_available, grouped_mm_experts, route
from tests import tiny
from tests.engine.reference import hf_logits, image_tokens, random_visual

TOL = 1e-4
MOE = ["qwen3_vl_moe", "qwen3_5_moe"]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed))


def _rewritten(folder, dst, edit) -> object:
    """A copy of the checkpoint at `folder` in `dst` whose tensors `edit` changed in place."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _diff(engine: Engine, model, ids: torch.Tensor) -> float:
    return float((engine.forward_logits(ids) - hf_logits(model, ids)).abs().max())


@pytest.mark.parametrize("family", MOE)
def test_top1_of_five_experts_prefill_and_20_decode_steps(family, tmp_path):
    model = tiny.build_model(family, seed=3, moe={"num_experts": 5, "num_experts_per_tok": 1})
    engine = Engine.from_pretrained(tiny.save_model(model, tmp_path))
    assert (engine.model_config.num_experts, engine.model_config.num_experts_per_tok) == (5, 1)
    grid = (1, 4, 6)
    visual = random_visual("image", grid, 64, engine.model_config.deepstack_levels, seed=4)
    prompt = Prompt([5, 6, *image_tokens(grid), 7, 8], [visual])
    session = engine.open_session()
    events = session.turn(prompt, SamplingParams(max_new_tokens=21, ignore_eos=True), return_logits=True).tokens()
    session.close()
    generated = [e.token_id for e in events]
    ids = torch.tensor(prompt.token_ids + generated[:-1])
    text = torch.zeros(len(ids), dtype=torch.bool)
    text[len(prompt.token_ids):] = True
    ref = hf_logits(model, ids, [visual], text)[len(prompt.token_ids) - 1:]
    assert float((torch.stack([e.logits for e in events]) - ref).abs().max()) <= TOL
    assert generated == ref.argmax(-1).tolist()


def test_qwen3_vl_moe_sparse_step_and_dense_layers(tmp_path):
    """`decoder_sparse_step` 2 over 3 layers: only layer 1 is sparse, and not when `mlp_only_layers` names it."""
    model = tiny.build_model("qwen3_vl_moe", seed=5, moe={"decoder_sparse_step": 2, "mlp_only_layers": [1]})
    engine = Engine.from_pretrained(tiny.save_model(model, tmp_path))
    assert engine.model_config.moe_layers == ()
    model = tiny.build_model("qwen3_vl_moe", seed=5, moe={"decoder_sparse_step": 2, "mlp_only_layers": []})
    engine = Engine.from_pretrained(tiny.save_model(model, tmp_path / "b"))
    assert engine.model_config.moe_layers == (1,)
    assert _diff(engine, model, _ids(23, 6)) <= TOL


def test_hub_layout_of_stacked_experts_is_read_transposed(tiny_checkpoints, tmp_path):
    """The Hub's Qwen3-VL-MoE checkpoints store `gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]`."""
    model, folder = tiny_checkpoints["qwen3_vl_moe"]

    def transpose(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()

    assert _diff(Engine.from_pretrained(_rewritten(folder, tmp_path, transpose)), model, _ids(31, 7)) <= TOL


@pytest.mark.parametrize("family", MOE)
def test_sharded_tied_checkpoint(family, tmp_path):
    model = tiny.build_model(family, seed=8, tie=True)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = Engine.from_pretrained(tmp_path)
    assert engine.model.lm_head.weight.data_ptr() == engine.model.embed_tokens.weight.data_ptr()
    assert _diff(engine, model, _ids(19, 9)) <= TOL


def test_text_only_qwen3_5_moe_causal_lm(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(tiny.build_config("qwen3_5_moe").text_config).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.mul_(50)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine.from_pretrained(tmp_path)
    assert engine.vision is None and engine.model_config.family == "qwen3_5_moe"
    ids = _ids(25, 10)
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    assert float((engine.forward_logits(ids) - ref).abs().max()) <= TOL


@pytest.mark.parametrize(("family", "name"), [
    ("qwen3_5_moe", "model.language_model.layers.2.mlp.experts.4.up_proj.weight"),
    ("qwen3_vl_moe", "model.language_model.layers.0.mlp.experts.down_proj"),
])
def test_a_missing_expert_tensor_is_named(tiny_checkpoints, tmp_path, family, name):
    folder = _rewritten(tiny_checkpoints[family][1], tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as err:
        Engine.from_pretrained(folder)
    assert err.value.missing == [name.removeprefix("model.language_model.")]


def test_expert_tensor_of_the_wrong_width_is_reported(tiny_checkpoints, tmp_path):
    name = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    folder = _rewritten(tiny_checkpoints["qwen3_vl_moe"][1], tmp_path,
                        lambda t: t.__setitem__(name, torch.zeros(7, 64, 64)))
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj has shape \(7, 64, 64\)"):
        Engine.from_pretrained(folder)


@pytest.mark.parametrize("op", [grouped_experts, grouped_mm_experts], ids=["loop", "grouped_mm"])
@pytest.mark.parametrize(("hidden", "inter"), [(16, 8), (8, 6)], ids=["aligned", "unaligned"])
def test_expert_ops_equal_each_row_through_its_experts(op, hidden, inter):
    """The unaligned widths (6 fp32 values: 24 bytes) take the loop inside the grouped-GEMM op."""
    if op is grouped_mm_experts and not grouped_mm_available("cpu"):
        pytest.skip("this torch has no _grouped_mm")
    g = torch.Generator().manual_seed(0)
    x, gate_up = torch.randn(9, hidden, generator=g), torch.randn(5, 2 * inter, hidden, generator=g)
    down = torch.randn(5, hidden, inter, generator=g)
    experts, weights = route(torch.randn(9, 5, generator=g) * 3, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(9))
    rows = []
    for r in range(9):
        acc = torch.zeros(hidden)
        for e, w in zip(experts[r].tolist(), weights[r], strict=True):
            gate, up = (gate_up[e] @ x[r]).chunk(2)
            acc += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    assert torch.allclose(op(x, experts, weights, gate_up, down), torch.stack(rows), atol=1e-5)


def test_the_cpu_backend_takes_the_grouped_gemm_where_torch_has_it():
    ops = backend.select("cpu", torch.float32, torch.float32, None)
    assert ops.moe is (grouped_mm_experts if grouped_mm_available("cpu") else grouped_experts)
    assert backend.OpSet(ops.attention, ops.gdn).moe is grouped_experts
