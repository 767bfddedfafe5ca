"""The README's openai-client example, as written, against a server on loopback (its address swapped in)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raincheck_demo.world import random_scene
from services.common.store import MemoryStore
from tests.demo.helpers import FOLDER

from .helpers import Stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keyless():
    if not (FOLDER / "model.safetensors").is_file():
        pytest.skip("models/demo has no trained checkpoint")
    s = Stack(MemoryStore(), api_keys=())
    yield s
    s.close()


def test_readme_openai_example(keyless, tmp_path):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                if "from openai import OpenAI" in b]
    (tmp_path / "scene.png").write_bytes(random_scene(random.Random(0)).png())
    code = block.replace("http://127.0.0.1:8000", keyless.http.url)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first.startswith("one ") and int(second.split()[-1]) > 144     # turn 1, its image included, cached
