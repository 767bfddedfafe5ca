"""The committed gRPC stubs are what proto/ generates (scripts/gen_protos.py --check), and the SDK ships
only the public API's: the services' internal worker.proto stubs live in services/_gen."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_protos():
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout


def test_the_sdk_ships_only_the_public_stubs():
    assert sorted(p.name for p in (ROOT / "raincheck_client" / "_gen").glob("*_pb2*")) == \
        ["chat_pb2.py", "chat_pb2.pyi", "chat_pb2_grpc.py"]
    worker = (ROOT / "services" / "_gen" / "worker_pb2.py").read_text()
    assert "from raincheck_client._gen import chat_pb2" in worker    # one registration of the shared types


def test_the_check_names_a_stale_stub(tmp_path):
    """A proto changed without `make protos` fails the check (run on a copy, so the tree is left alone)."""
    for part in ("proto", "scripts", "raincheck_client/_gen", "services/_gen"):
        shutil.copytree(ROOT / part, tmp_path / part)
    proto = tmp_path / "proto" / "raincheck" / "v1" / "chat.proto"
    proto.write_text(proto.read_text().replace("message ListModelsRequest {}",
                                               "message AaaProbe {}\n\nmessage ListModelsRequest {}"))
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "raincheck_client/_gen/chat_pb2.py" in result.stderr, result.stderr
    assert "services/_gen/worker_pb2.py" not in result.stderr
