"""Qwen3.5's MTP head (models/mtp.py) and its drafter (speculative/mtp.py), dense and MoE.

The reference is the head built from transformers' own Qwen3.5 layers (raincheck_demo/mtp.py: a
full-attention decoder layer, its norms and rotary embedding) under the checkpoint's names, run over all
rows at once with a causal mask; its weights are written to a safetensors file with the checkpoint's
`mtp.*` names and loaded back.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from raincheck_core.config import ModelConfig
from raincheck_core.errors import CheckpointError, NoMtpHeadError
from raincheck_core.models import build_decoder
from raincheck_core.models.mtp import load_mtp_head
from raincheck_core.speculative.mtp import MtpDrafter
from raincheck_demo.mtp import TransformersMtp
from tests import tiny

FAMILIES = ("qwen3_5", "qwen3_5_moe")


def write_checkpoint(folder, family: str, seed: int = 0, with_mtp: bool = True):
    """config.json (declaring one MTP layer) and model.safetensors holding a random MTP head (and one
    decoder tensor, which the MTP loader must leave alone); returns the reference head."""
    hf = tiny.build_config(family)
    hf.text_config.mtp_num_hidden_layers = 1
    (folder / "config.json").write_text(json.dumps(hf.to_dict()))
    torch.manual_seed(seed)
    ref = TransformersMtp(hf.text_config, family.endswith("moe")).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # norms perturbed (a wrong `w` vs `1 + w` shows), routers sharp (a wrong top-k shows)
            p.copy_(0.1 * torch.randn_like(p) if p.dim() == 1 else
                    torch.randn_like(p) * (1.0 if name.endswith("mlp.gate.weight") else 0.15))
    tensors = ref.checkpoint() if with_mtp else {}
    tensors["model.language_model.norm.weight"] = torch.zeros(hf.text_config.hidden_size)
    save_file(tensors, str(folder / "model.safetensors"))
    return ref


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = write_checkpoint(folder, request.param)
    cfg = ModelConfig.from_folder(folder)
    torch.manual_seed(1)
    target = build_decoder(cfg)          # lends its embedding and LM head (default init)
    head = load_mtp_head(cfg, folder)
    return cfg, ref, target, head


def rows(cfg: ModelConfig, n: int, seed: int):
    """`n` rows: next tokens, target hidden states, and rope positions with a visual block (3-D positions)
    between text rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, cfg.hidden_size, generator=g)
    pos = torch.arange(n).repeat(3, 1)
    if n >= 10:      # rows 3..8: a 1×2×3 grid at position 3; text resumes at 3 + 3
        grid = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]])
        pos[:, 3:9] = 3 + grid
        pos[:, 9:] = torch.arange(6, 6 + n - 9)
    return tokens, hidden, pos


def reference(ref: TransformersMtp, target, tokens, hidden, pos) -> torch.Tensor:
    with torch.no_grad():
        return ref(target.embed_tokens(tokens)[None], hidden[None], pos[:, None])[0]


def reference_drafts(ref: TransformersMtp, target, tokens, hidden, pos, k: int) -> list[int]:
    """The head chained k times, each draft recomputed from scratch over every row before it."""
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            out = reference(ref, target, tokens, hidden, pos)
            drafts.append(int(target.lm_head(out[-1:]).argmax(-1)))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            hidden = torch.cat([hidden, out[-1:]])
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    return drafts


def drafter(head, target, pages: int = 64) -> MtpDrafter:
    return MtpDrafter(head, target, num_pages=pages, page_size=4)


def test_config_declares_the_layers(setup):
    cfg, *_ = setup
    assert cfg.mtp_layers == 1


def test_incremental_observe_matches_reference(setup):
    """Rows observed in pieces of several sizes: the head's output at each piece's last row equals the
    reference over all rows at once."""
    cfg, ref, target, head = setup
    tokens, hidden, pos = rows(cfg, 23, seed=2)
    want = reference(ref, target, tokens, hidden, pos)
    d = drafter(head, target)
    start = 0
    for size in (5, 1, 7, 1, 1, 8):
        end = start + size
        d.observe("s", tokens[start:end], pos[:, start:end], hidden[start:end])
        torch.testing.assert_close(d.tracks["s"].last, want[end - 1], atol=1e-5, rtol=0)
        start = end


@pytest.mark.parametrize("k", [1, 2, 3])
def test_propose_chains_the_head(setup, k):
    """propose(k) equals the head chained on its own outputs, each step computed from scratch; the draft
    rows' K/V do not stay (a second propose gives the same drafts)."""
    cfg, ref, target, head = setup
    tokens, hidden, pos = rows(cfg, 12, seed=3)
    d = drafter(head, target)
    d.observe("s", tokens, pos, hidden)
    history = [0] * 12 + [int(tokens[-1])]      # the last observed row is token 11, its next token 12
    want = reference_drafts(ref, target, tokens, hidden, pos, k)
    assert d.propose("s", history, k) == want
    assert d.propose("s", history, k) == want
    assert d.tracks["s"].table.length == 12


def test_rollback_equals_recomputing(setup):
    """Rows observed and then rolled back leave the drafter as if they had never come: its outputs and
    drafts equal a drafter that saw only the kept rows and what followed."""
    cfg, ref, target, head = setup
    tokens, hidden, pos = rows(cfg, 16, seed=4)
    other_tokens, other_hidden, _ = rows(cfg, 16, seed=5)
    rolled, fresh = drafter(head, target), drafter(head, target)
    rolled.observe("s", tokens[:10], pos[:, :10], hidden[:10])
    assert rolled.propose("s", [0] * 10 + [int(tokens[9])], 2)          # pins rows 0..9 as tokens 0..9
    rolled.observe("s", tokens[10:14], pos[:, 10:14], hidden[10:14])     # rows 10..13, to be undone
    rolled.rollback("s", 11)      # keeps the rows whose next token is within the first 11: rows 0..9
    assert rolled.tracks["s"].table.length == 10
    assert rolled.propose("s", [0] * 15, 2) == []                        # forgot what it drafts from
    # what follows instead
    new_tokens = torch.cat([tokens[:10], other_tokens[10:]])
    new_hidden = torch.cat([hidden[:10], other_hidden[10:]])
    rolled.observe("s", new_tokens[10:15], pos[:, 10:15], new_hidden[10:15])
    fresh.observe("s", new_tokens[:15], pos[:, :15], new_hidden[:15])
    torch.testing.assert_close(rolled.tracks["s"].last, fresh.tracks["s"].last, atol=1e-6, rtol=0)
    torch.testing.assert_close(rolled.tracks["s"].last, reference(ref, target, new_tokens[:15], new_hidden[:15],
                                                                  pos[:, :15])[-1], atol=1e-5, rtol=0)
    history = [0] * 15 + [int(new_tokens[14])]
    assert rolled.propose("s", history, 3) == fresh.propose("s", history, 3) == \
        reference_drafts(ref, target, new_tokens[:15], new_hidden[:15], pos[:, :15], 3)


def test_rollback_after_a_gap_forgets_rather_than_keeps(setup):
    """Rows 5..9 deferred (never observed): the pinned indices of rows before the gap are too large, so a
    rollback forgets them too (a drafter that sees less is still exact), and never keeps a rolled-back row."""
    cfg, _, target, head = setup
    tokens, hidden, pos = rows(cfg, 14, seed=6)
    d = drafter(head, target)
    d.observe("s", tokens[:5], pos[:, :5], hidden[:5])
    d.observe("s", tokens[10:13], pos[:, 10:13], hidden[10:13])
    assert d.propose("s", [0] * 13 + [int(tokens[12])], 1)     # row 12 is token 12
    assert d.tracks["s"].index == [5, 6, 7, 8, 9, 10, 11, 12]
    d.rollback("s", 12)           # row 11 (next token 12) goes; rows 0..4 pinned as 5..9 and row 10 stay
    assert d.tracks["s"].table.length == 6
    d.rollback("s", 8)            # true rows 0..4 would stay; pinned too high, the drafter keeps rows 0..1
    assert d.tracks["s"].table.length == 2


def test_propose_needs_the_row_before_the_last_token(setup):
    cfg, _, target, head = setup
    tokens, hidden, pos = rows(cfg, 6, seed=7)
    d = drafter(head, target)
    assert d.propose("s", [1, 2, 3], 2) == []                       # nothing observed
    d.observe("s", tokens, pos, hidden)
    assert d.propose("s", [0] * 6 + [int(tokens[-1]) + 1], 2) == []   # history ends with another token
    assert d.propose("s", [int(tokens[-1])], 2) == []                # six rows cannot end at token 0
    assert len(d.propose("s", [0] * 6 + [int(tokens[-1])], 2)) == 2


def test_sessions_are_apart_and_release_frees_pages(setup):
    cfg, _, target, head = setup
    tokens, hidden, pos = rows(cfg, 12, seed=8)
    d = drafter(head, target, pages=8)
    free = d.pool.stats().free_pages
    d.observe("a", tokens, pos, hidden)
    d.observe("b", tokens[:5], pos[:, :5], hidden[:5])
    alone = drafter(head, target)
    alone.observe("a", tokens, pos, hidden)
    torch.testing.assert_close(d.tracks["a"].last, alone.tracks["a"].last, atol=0, rtol=0)
    d.release("a")
    d.release("b")
    assert d.pool.stats().free_pages == free


def test_a_short_pool_forgets_instead_of_failing(setup):
    """Rows past what the pool holds: the session starts afresh from the new rows (as if the earlier ones
    had never been observed)."""
    cfg, ref, target, head = setup
    tokens, hidden, pos = rows(cfg, 12, seed=9)
    d = drafter(head, target, pages=2)          # 8 slots
    d.observe("s", tokens[:6], pos[:, :6], hidden[:6])
    d.observe("s", tokens[6:12], pos[:, 6:12], hidden[6:12])
    assert d.tracks["s"].table.length == 6
    torch.testing.assert_close(d.tracks["s"].last, reference(ref, target, tokens[6:], hidden[6:], pos[:, 6:])[-1],
                               atol=1e-5, rtol=0)
    assert d.tracks["s"].index == list(range(6, 12))


def test_checkpoint_without_mtp_is_a_typed_error(tmp_path):
    write_checkpoint(tmp_path, "qwen3_5", with_mtp=False)
    with pytest.raises(NoMtpHeadError, match="no multi-token-prediction head"):
        load_mtp_head(ModelConfig.from_folder(tmp_path), tmp_path)


def test_mismatched_mtp_names_the_tensors(tmp_path):
    write_checkpoint(tmp_path, "qwen3_5")
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["mtp.fc.weight"]
    tensors["mtp.layers.1.input_layernorm.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight") as e:
        load_mtp_head(ModelConfig.from_folder(tmp_path), tmp_path)
    assert e.value.unexpected == ["mtp.layers.1.input_layernorm.weight"]


def test_an_engines_drafter_from_its_checkpoint(tmp_path):
    """`from_checkpoint` sizes the head's pool by the engine's pages and drafts as the head loaded by hand."""
    from raincheck_core.config import EngineConfig

    write_checkpoint(tmp_path, "qwen3_5")
    cfg = ModelConfig.from_folder(tmp_path)
    target = build_decoder(cfg)
    d = MtpDrafter.from_checkpoint(tmp_path, target, EngineConfig(num_pages=32, page_size=8, backend="native"))
    assert tuple(d.pool.k.shape) == (1, 32 * 8, cfg.num_kv_heads, cfg.head_dim)
    by_hand = drafter(load_mtp_head(cfg, tmp_path), target)
    tokens, hidden, pos = rows(cfg, 9, seed=10)
    history = [0] * 9 + [int(tokens[-1])]
    for each in (d, by_hand):
        each.observe("s", tokens, pos, hidden)
    assert d.propose("s", history, 3) == by_hand.propose("s", history, 3)
