"""Generates the Python stubs of proto/raincheck/v1/*.proto into the packages that use them.

    python scripts/gen_protos.py           # (re)write the stubs: `make protos`
    python scripts/gen_protos.py --check   # exit 1, naming the stale files, if they differ from proto/

The stubs are committed, so that the SDK and the services import them with nothing but protobuf and
grpcio (no grpcio-tools, no write access, no proto/ at run time); tests/client/test_generated_stubs.py
runs `--check`, so a .proto changed without `make protos` fails the suite. Where each proto goes:
- chat.proto, the public API: raincheck_client/_gen/ (the SDK ships it);
- worker.proto, the services' internal API: services/_gen/ (the SDK does not ship it).
protoc writes imports as the protos' package path (`from raincheck.v1 import chat_pb2`); they are
rewritten to where that module lives here, and the module name its classes report becomes the module's
own `__name__`.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE = "raincheck/v1"
# proto file -> the folder (a Python package) its stubs go to
DESTINATIONS = {"chat.proto": "raincheck_client/_gen", "worker.proto": "services/_gen"}
_IMPORT = re.compile(r"^from raincheck\.v1 import (\w+?)(_pb2(?:_grpc)?) ", re.MULTILINE)
_MODULE_NAME = re.compile(r"'raincheck\.v1\.\w+_pb2'")


def _import_of(module: str, importer: str) -> str:
    """How a stub in the folder `importer` imports the stub `module` (e.g. chat_pb2)."""
    folder = DESTINATIONS[module.split("_pb2")[0] + ".proto"]
    if folder == importer:
        return "from . import "
    if folder.startswith("services/"):
        raise ValueError(f"{module} is internal (services/); a stub in {importer} may not import it")
    return f"from {folder.replace('/', '.')} import "


def _rewrite(text: str, folder: str) -> str:
    text = _IMPORT.sub(lambda m: _import_of(m.group(1) + m.group(2), folder) + m.group(1) + m.group(2) + " ", text)
    return _MODULE_NAME.sub("__name__", text)


def generate() -> dict[Path, str]:
    """Path in the repository -> the stub's text, for every proto."""
    from grpc_tools import protoc

    out: dict[Path, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for proto, folder in DESTINATIONS.items():
            args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                    f"--grpc_python_out={tmp}", f"{PACKAGE}/{proto}"]
            if protoc.main(args) != 0:
                sys.exit(f"protoc failed on {proto}")
            stem = proto.removesuffix(".proto")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                text = (Path(tmp) / PACKAGE / f"{stem}{suffix}").read_text()
                out[Path(folder) / f"{stem}{suffix}"] = _rewrite(text, folder)
    unknown = {p.name for p in (PROTO_ROOT / PACKAGE).glob("*.proto")} - set(DESTINATIONS)
    if unknown:
        sys.exit(f"no destination for {sorted(unknown)}: add them to DESTINATIONS in {Path(__file__).name}")
    return out


def stale(stubs: dict[Path, str]) -> list[str]:
    """Stubs that differ from what the protos generate, and stub files no proto generates."""
    wrong = [str(p) for p, text in stubs.items() if not (ROOT / p).is_file() or (ROOT / p).read_text() != text]
    for folder in set(DESTINATIONS.values()):
        wrong += [str(p.relative_to(ROOT)) for p in sorted((ROOT / folder).glob("*_pb2*"))
                  if p.relative_to(ROOT) not in stubs]
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed stubs are current")
    args = parser.parse_args()
    stubs = generate()
    if args.check:
        wrong = stale(stubs)
        if wrong:
            sys.exit(f"stale generated stubs (run `make protos`): {', '.join(wrong)}")
        print(f"{len(stubs)} generated stubs match proto/")
        return
    for path, text in stubs.items():
        (ROOT / path).write_text(text)
    for path in stale(stubs):     # left over from a proto that is gone
        (ROOT / path).unlink()
    print(f"wrote {len(stubs)} stubs: {', '.join(sorted(map(str, stubs)))}")


if __name__ == "__main__":
    main()
