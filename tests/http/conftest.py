"""Fixtures of the HTTP frontend's tests: a stack on the in-process store per module (the demo model, or a
tiny random checkpoint whose chat template renders tools); Redis tests use the `redis_prefix` fixture of
tests/services."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.store import MemoryStore
from tests.demo.helpers import FOLDER
from tests.services.conftest import redis_prefix  # noqa: F401  (the fixture, reused)

from .helpers import Stack, random_model_stack


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
    stack = random_model_stack(tmp_path_factory.mktemp("tool-model"),
                               Path(__file__).parent / "data" / "qwen_tool_format.jinja")
    yield stack
    stack.close()
