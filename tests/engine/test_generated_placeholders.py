"""A generated token that equals a visual placeholder id is text in the next turn, not a placeholder.

The model may sample any id of its vocabulary, the image token's included; the answer's unfed tail is
fed first by the next turn, and used to be counted as an image token there ("prompt has 1 image tokens
but no image was given")."""

from __future__ import annotations

import shutil

import pytest
import torch

from raincheck_core import Engine, Message, SamplingParams
from raincheck_core.engine.events import TokenEvent
from raincheck_core.errors import InvalidInputError
from raincheck_core.multimodal import compute_positions
from tests.multimodal.mm_helpers import IMAGE, QWEN_TEMPLATE, VIDEO, png, save_tokenizer


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tmp_path_factory):
    folder = shutil.copytree(tiny_checkpoints["qwen3_5"][1], tmp_path_factory.mktemp("gp") / "ckpt")
    save_tokenizer(folder, QWEN_TEMPLATE)
    return Engine.from_pretrained(folder)


def _favouring(engine: Engine, token: int):
    """Make the model's head pick `token` (a forward hook on its lm_head)."""
    def hook(_module, _inputs, logits):
        logits[..., token] += 1e4
        return logits
    return engine.model.lm_head.register_forward_hook(hook)


def _answer(session, message, **kw) -> list[int]:
    return [e.token_id for e in session.turn(message, SamplingParams(**kw)) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("placeholder", [IMAGE, VIDEO])
def test_generated_placeholder_is_text_next_turn(engine, placeholder):
    session = engine.open_session()
    handle = _favouring(engine, placeholder)
    try:
        first = _answer(session, Message("what is this ?", images=[png()]), max_new_tokens=3)
    finally:
        handle.remove()
    assert first == [placeholder] * 3
    second = _answer(session, Message("what is this ?"), max_new_tokens=3)  # no visual given
    third = _answer(session, Message("what is this ?", images=[png(64, 64)]), max_new_tokens=3)
    assert len(second) == 3 and len(third) == 3
    session.close()


def test_token_level_turns_too(engine):
    session = engine.open_session()
    handle = _favouring(engine, IMAGE)
    try:
        assert _answer(session, [4, 5, 6], max_new_tokens=1) == [IMAGE]
    finally:
        handle.remove()
    assert len(_answer(session, [7, 8], max_new_tokens=2)) == 2
    session.close()


def test_text_prefix_positions():
    ids = [IMAGE, 4, 5]
    with pytest.raises(InvalidInputError, match="1 image tokens but no image"):
        compute_positions(ids, [], image_token_id=IMAGE, video_token_id=VIDEO, merge=2)
    layout = compute_positions(ids, [], image_token_id=IMAGE, video_token_id=VIDEO, merge=2, start=7,
                               text_prefix=1)
    assert torch.equal(layout.positions, torch.arange(7, 10).expand(3, 3))
    assert layout.next_position == 10
