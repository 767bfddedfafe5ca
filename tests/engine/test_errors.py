"""Bad input gets a clear typed error, and the engine keeps serving afterwards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raincheck_core import (
    CheckpointError,
    Engine,
    InvalidInputError,
    OutOfPagesError,
    Prompt,
    RequestTooLargeError,
    SamplingParams,
    SessionBusyError,
    SessionClosedError,
    UnsupportedModelError,
)
from raincheck_core.deferral.policy import DeferralConfig
from tests.deferral.helpers import image_prompt
from tests.engine.reference import image_tokens, random_visual


def _copy(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def _edit_tensors(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_unexpected_tensors_are_named(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints["qwen3_5"][1], tmp_path)

    def edit(t):
        del t["model.language_model.layers.1.linear_attn.A_log"]
        t["model.language_model.layers.1.bogus.weight"] = torch.zeros(2)

    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError) as err:
        Engine.from_pretrained(folder)
    assert "layers.1.linear_attn.A_log" in str(err.value)
    assert "model.language_model.layers.1.bogus.weight" in str(err.value)
    assert err.value.missing == ["layers.1.linear_attn.A_log"]


def test_wrong_shape_is_reported(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints["qwen3_vl"][1], tmp_path)
    _edit_tensors(folder, lambda t: t.__setitem__("model.language_model.norm.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"norm\.weight has shape"):
        Engine.from_pretrained(folder)


def test_missing_weights_file(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints["qwen3_vl"][1], tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        Engine.from_pretrained(folder)


def test_unknown_model_type(tiny_checkpoints, tmp_path):
    folder = _copy(tiny_checkpoints["qwen3_vl"][1], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llava"
    cfg["text_config"]["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'llava' is not supported"):
        Engine.from_pretrained(folder)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return Engine.from_pretrained(tiny_checkpoints["qwen3_vl"][1], num_pages=64, page_size=8,
                                  max_pages_per_session=16)


def test_image_tokens_without_an_image(engine):
    session = engine.open_session()
    with pytest.raises(InvalidInputError, match="image"):
        session.turn(Prompt([5] + image_tokens((1, 4, 4)) + [6]))
    # the session is untouched and still works
    assert session.cached_tokens == 0
    assert len(session.turn(Prompt([5, 6, 7]), SamplingParams(max_new_tokens=3)).tokens()) >= 1
    session.close()


def test_visual_with_wrong_shape(engine):
    session = engine.open_session()
    bad = random_visual("image", (1, 4, 4), 32, 2, seed=0)      # hidden 32, the model has 64
    with pytest.raises(InvalidInputError, match="expected"):
        session.turn(Prompt([5] + image_tokens((1, 4, 4)), [bad]))
    session.close()


def test_session_over_its_page_budget_then_engine_still_serves(engine):
    free_before = engine.pool_stats().free_pages
    session = engine.open_session()
    # 164 slots > 16 pages x 8: no wait can cure it, so it is an invalid request, not a full pool
    with pytest.raises(RequestTooLargeError, match=r"a session of this worker holds at most 128 tokens; .* 164 req"):
        session.turn(Prompt(list(range(100))), SamplingParams(max_new_tokens=64))
    assert session.cached_tokens == 0
    session.close()
    assert engine.pool_stats().free_pages == free_before
    other = engine.open_session()
    assert len(other.turn(Prompt([1, 2, 3]), SamplingParams(max_new_tokens=4, ignore_eos=True)).tokens()) == 4
    other.close()
    assert engine.pool_stats().free_pages == free_before


def test_pool_exhaustion_is_typed_and_recoverable(engine):
    sessions = [engine.open_session() for _ in range(5)]
    with pytest.raises(OutOfPagesError, match="pool exhausted"):
        for s in sessions:   # each asks for 15 of the pool's 64 pages
            s.turn(Prompt(list(range(60))), SamplingParams(max_new_tokens=60))
    for s in sessions:
        s.close()
    assert engine.pool_stats().free_pages == engine.pool_stats().total_pages


def test_turn_while_busy_and_after_close(engine):
    session = engine.open_session()
    stream = session.turn(Prompt([1, 2, 3]), SamplingParams(max_new_tokens=8, ignore_eos=True))
    next(iter(stream))
    with pytest.raises(SessionBusyError):
        session.turn(Prompt([4]))
    assert len(list(stream)) == 8   # 7 more tokens and the end event
    session.close()
    with pytest.raises(SessionClosedError):
        session.turn(Prompt([4]))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)])
def test_bad_sampling_values(kwargs):
    with pytest.raises(InvalidInputError):
        SamplingParams(**kwargs)


def test_token_ids_out_of_range(engine):
    session = engine.open_session()
    with pytest.raises(InvalidInputError, match="out of range"):
        session.turn(Prompt([5, 10_000]))
    with pytest.raises(InvalidInputError, match="no input tokens"):
        session.turn(Prompt([]))
    session.close()


def test_a_turn_past_the_context_length_is_refused_in_tokens(tiny_checkpoints):
    folder = tiny_checkpoints["qwen3_5"][1]
    engine = Engine.from_pretrained(folder, max_model_len=40)
    session = engine.open_session()
    session.turn(Prompt(list(range(5, 25))), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    held = session.cached_tokens
    with pytest.raises(RequestTooLargeError, match=rf"maximum context length is 40 tokens; the conversation holds "
                                                   rf"{held}, this turn's prompt is \d+ and max_new_tokens is 12"):
        session.turn(Prompt([5, 6, 7, 8, 9, 10]), SamplingParams(max_new_tokens=12))
    assert session.cached_tokens == held and session.turns == 1          # refused before anything changed
    session.turn(Prompt([5, 6]), SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
    default = Engine.from_pretrained(folder)
    assert default.core.max_model_len == default.model_config.max_position_embeddings is not None
    with pytest.raises(RequestTooLargeError, match="maximum context length"):
        default.open_session().turn(Prompt([5]), SamplingParams(max_new_tokens=default.core.max_model_len))


def test_the_previous_turns_pending_deferred_rows_count_against_the_context(tiny_checkpoints):
    engine = Engine.from_pretrained(tiny_checkpoints["qwen3_5"][1], max_model_len=60)
    session = engine.open_session(deferral=DeferralConfig("post_answer", selector="uniform"))
    session.turn(image_prompt(engine, seed=3), SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
    held, pending = session.cached_tokens, session.pending_deferred
    assert pending == 16
    fits_without_them = 60 - held - 2            # a prompt of 2 rows (the unfed token + 1): 60 - held in all
    with pytest.raises(RequestTooLargeError, match=f"the conversation holds {held + pending},"):
        session.turn(Prompt([5]), SamplingParams(max_new_tokens=fits_without_them))
    assert session.pending_deferred == pending   # refused before the barrier ran
