"""The stubs are generated on import from proto/ (nothing generated is committed), and regenerated when a
proto changes: checked on a copy of the package, so the working tree's stubs are left alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = ("from raincheck_client._gen import chat_pb2, worker_pb2\n"
          "print(list(chat_pb2.DESCRIPTOR.message_types_by_name))")


def _import(folder: Path) -> str:
    result = subprocess.run([sys.executable, "-c", IMPORT], cwd=folder, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_stubs_generated_on_import_and_when_stale(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copytree(ROOT / "raincheck_client", tmp_path / "raincheck_client",
                    ignore=shutil.ignore_patterns("*_pb2*", ".stamp", ".lock", "__pycache__"))
    gen = tmp_path / "raincheck_client" / "_gen"
    assert not list(gen.glob("*_pb2*.py"))
    _import(tmp_path)
    assert {p.name for p in gen.glob("*_pb2*.py")} == {"chat_pb2.py", "chat_pb2_grpc.py", "worker_pb2.py",
                                                       "worker_pb2_grpc.py"}
    assert "from . import chat_pb2" in (gen / "worker_pb2.py").read_text()
    stamp = (gen / ".stamp").read_text()

    proto = tmp_path / "proto" / "raincheck" / "v1" / "chat.proto"
    proto.write_text(proto.read_text().replace("message ListModelsRequest {}", "message AaaProbe {}\n\n"
                                               "message ListModelsRequest {}"))
    assert "AaaProbe" in _import(tmp_path)
    assert (gen / ".stamp").read_text() != stamp
