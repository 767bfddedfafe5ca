"""Fixtures of the HTTP frontend's tests: a stack on the in-process store per module (the demo model, or a
tiny random checkpoint whose chat template renders tools); Redis tests use the `redis_prefix` fixture of
tests/services."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.random_model import save_random_model
from services.common.store import MemoryStore
from tests.demo.helpers import FOLDER
from tests.services.conftest import redis_prefix  # noqa: F401  (the fixture, reused)

from .helpers import Stack


@pytest.fixture(scope="module")
def stack():
    if not (FOLDER / "model.safetensors").is_file():
        pytest.skip("models/demo has no trained checkpoint")
    s = Stack(MemoryStore())
    yield s
    s.close()


@pytest.fixture(scope="module")
def tool_stack(tmp_path_factory):
    """A stack on a tiny random checkpoint (every printable ASCII character is a token; answers are noise),
    its chat template rendering tools in Qwen's format (data/qwen_tool_format.jinja)."""
    from transformers import AutoTokenizer

    folder = save_random_model(tmp_path_factory.mktemp("tool-model"), "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = (Path(__file__).parent / "data" / "qwen_tool_format.jinja").read_text()
    tokenizer.save_pretrained(folder)
    stack = Stack(MemoryStore(), folder=folder)
    yield stack
    stack.close()
