"""Protobuf and gRPC stubs of `proto/raincheck/v1/*.proto`, generated here on first import.

The generated modules are not committed. On import, when they are missing or stale (the `.stamp` file
holds a hash of the .proto sources and the grpcio-tools version), they are regenerated with grpcio-tools
under a file lock, so concurrent importers do not race. The protos are compiled under their package path
(`-I proto`, `raincheck/v1/...`), then their imports of each other (`from raincheck.v1 import x_pb2`)
are made relative, so the stubs live inside this package. A copy installed without the proto sources
uses the modules it was installed with.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).parent
PROTO_ROOT = HERE.parents[1] / "proto"
PACKAGE = Path("raincheck/v1")
_STAMP = HERE / ".stamp"
# What the generated code says about its own location, rewritten for this package:
_REWRITES = (
    (re.compile(r"^from raincheck\.v1 import ", re.MULTILINE), "from . import "),   # sibling imports
    (re.compile(r"'raincheck\.v1\.(\w+_pb2)'"), "__name__"),   # the module its classes report (pickling)
)


def _tools_version() -> str:
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return "absent"


def _fingerprint(sources: list[Path]) -> str:
    digest = hashlib.sha256(_tools_version().encode())
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    return digest.hexdigest()


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _generate(sources: list[Path], fingerprint: str) -> None:
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError(
            "raincheck_client's gRPC stubs are missing or stale and grpcio-tools is not installed to "
            "generate them: pip install grpcio-tools"
        ) from e
    with tempfile.TemporaryDirectory() as out:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", *(str(src) for src in sources)]
        if protoc.main(args) != 0:
            raise ImportError(f"grpc_tools.protoc failed on {[s.name for s in sources]}")
        for path in sorted((Path(out) / PACKAGE).iterdir()):
            text = path.read_text()
            for pattern, replacement in _REWRITES:
                text = pattern.sub(replacement, text)
            _write(HERE / path.name, text)
    _write(_STAMP, fingerprint)


def _ensure_generated() -> None:
    sources = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not sources:
        return  # an installed copy: use the shipped modules
    fingerprint = _fingerprint(sources)
    if _STAMP.is_file() and _STAMP.read_text() == fingerprint:
        return
    with open(HERE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (_STAMP.is_file() and _STAMP.read_text() == fingerprint):
            _generate(sources, fingerprint)


_ensure_generated()

from . import chat_pb2, chat_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

__all__ = ["chat_pb2", "chat_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
