"""Fixtures of the HTTP frontend's tests: a stack on the in-process store per module; Redis tests use
the `redis_prefix` fixture of tests/services."""

from __future__ import annotations

import pytest

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
