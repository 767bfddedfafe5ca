"""The client SDK needs only grpcio and protobuf: importing and using it never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
import raincheck_client
from raincheck_client import AsyncClient, Client
from raincheck_client._gen import chat_pb2
client = Client("127.0.0.1:1")
request = raincheck_client._build.chat("s", "hi", [b"png"], [], follow_recovery=False, policy=None)
assert request.message.images == [b"png"]
client.close()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "raincheck_core", "services", "numpy"))
assert heavy == ["torch"] and sys.modules["torch"] is None, heavy
print("ok")
"""


def test_client_imports_without_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
