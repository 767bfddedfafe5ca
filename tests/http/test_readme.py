"""The README's openai-client example, as written, against a server on loopback (its address swapped in)
serving what `raincheck serve` serves: the demo model, v2 (`models/demo-v2`)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raincheck_demo.world import random_scene
from services.common.store import MemoryStore
from tests.demo.helpers import V2

from .helpers import Stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keyless():
    if not (V2 / "model.safetensors").is_file():
        pytest.skip("models/demo-v2 has no trained checkpoint")
    s = Stack(MemoryStore(), folder=V2, api_keys=())
    yield s
    s.close()


def test_readme_scene_one_liner(tmp_path):
    """The README's command that renders scene.png, run as written (outside the checkout: the installed
    raincheck_demo), writes the scene the examples below use."""
    (code,) = re.findall(r'\.venv/bin/python -c "(.*?)"\n', (ROOT / "README.md").read_text(), re.S)
    out = subprocess.run([sys.executable, "-c", code.replace("\\\n", "")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "scene.png").read_bytes() == random_scene(random.Random(0)).png()


def test_readme_openai_example(keyless, tmp_path):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                if "from openai import OpenAI" in b]
    (tmp_path / "scene.png").write_bytes(random_scene(random.Random(0)).png())
    code = block.replace("http://127.0.0.1:8000", keyless.http.url)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first.startswith("one ") and int(second.split()[-1]) > 144     # turn 1, its image included, cached
