"""The two distributions, built as wheels: the SDK installs into a fresh virtualenv with grpcio and
protobuf only (no torch), and the README's SDK example, run there as written, holds a two-turn image
chat with `raincheck serve` on the demo model.

Offline: the fresh virtualenv installs with `--no-index` from a folder holding the SDK's wheel and wheels
repacked from the distributions this project's virtualenv already has (grpcio, protobuf and what they
need), so nothing is downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from raincheck_demo.world import random_scene

ROOT = Path(__file__).resolve().parents[2]
SKIP_IN_WHEEL = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
pytestmark = pytest.mark.slow


def _build(project: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(project)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = [w for w in out.glob("*.whl") if w.name.startswith(project.name.replace("-", "_"))]
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, built from copies of the sources (no build folders in the working tree)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    client = src / "raincheck-client"
    shutil.copytree(ROOT / "raincheck_client", client, ignore=junk)
    server = src / "raincheck-serve"
    for part in ("raincheck_core", "raincheck_demo", "services", "requirements"):
        shutil.copytree(ROOT / part, server / part, ignore=junk)
    for part in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / part, server / part)
    return {"client": _build(client, out), "server": _build(server, out)}


def _wheel_metadata(wheel: Path) -> tuple[set[str], list[str], list[str]]:
    """(top-level names, files, Requires-Dist) of a wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    return tops, names, meta.get_all("Requires-Dist") or []


def test_the_sdk_wheel_holds_the_sdk_and_needs_only_grpcio_and_protobuf(wheels):
    tops, files, requires = _wheel_metadata(wheels["client"])
    assert tops == {"raincheck_client"}
    assert "raincheck_client/_gen/chat_pb2_grpc.py" in files and "raincheck_client/py.typed" in files
    assert not [f for f in files if "worker_pb2" in f or f.endswith(("pyproject.toml", ".md"))], files
    assert sorted(Requirement(r).name for r in requires) == ["grpcio", "protobuf"]


def test_the_server_wheel_installs_no_generic_names_and_declares_its_dependencies(wheels):
    tops, files, requires = _wheel_metadata(wheels["server"])
    assert tops == {"raincheck_core", "raincheck_demo", "raincheck_serve"}
    assert "raincheck_demo/world.py" in files and "raincheck_demo/train.py" in files, "`raincheck demo` plays its world"
    assert not [f for f in files if f.endswith(".safetensors")], "no checkpoint is in the wheel"
    packages = {str(p.parent.relative_to(ROOT / "services")) for p in (ROOT / "services").rglob("__init__.py")}
    shipped = {str(Path(f).parent.relative_to("raincheck_serve")) for f in files
               if f.startswith("raincheck_serve/") and f.endswith("/__init__.py")}
    assert shipped == packages, "every package under services/ is installed, as raincheck_serve"
    assert "raincheck_serve/_gen/worker_pb2.pyi" in files
    assert {"raincheck_core/ops/csrc/paged_attention.c", "raincheck_core/ops/csrc/fast_math.h"} <= set(files), \
        "the native kernels' sources are built on first use"
    declared = {Requirement(r).name: Requirement(r) for r in requires}
    listed = [Requirement(line) for line in (ROOT / "requirements" / "runtime.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert {r.name for r in listed} | {"raincheck-client"} == set(declared)
    assert str(declared["raincheck-client"].specifier) == "==" + metadata.version("raincheck-client")
    for req in listed:     # every bound holds for what this virtualenv tests with
        assert req.specifier.contains(metadata.version(req.name), prereleases=True), (req, metadata.version(req.name))


def _repack(name: str, out: Path) -> None:
    """A wheel of the installed distribution `name`, from its files in this virtualenv."""
    dist = metadata.distribution(name)
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: "))
    info = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}.dist-info"
    wheel = out / f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for file in dist.files:
            path = str(file)
            if path.startswith("..") or "__pycache__" in path or Path(path).name in SKIP_IN_WHEEL:
                continue
            data = Path(dist.locate_file(file)).read_bytes()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


def _wheelhouse(sdk: Path, out: Path) -> None:
    """The SDK's wheel and, repacked, every distribution it needs (recursively) from this virtualenv."""
    shutil.copy(sdk, out)
    todo, done = [str(r) for r in _wheel_metadata(sdk)[2]], set()
    while todo:
        req = Requirement(todo.pop())
        if req.name in done or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        done.add(req.name)
        _repack(req.name, out)
        todo += metadata.distribution(req.name).requires or []


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from raincheck_client import" in b]
    return block


def test_the_sdk_in_a_fresh_venv_chats_with_raincheck_serve(wheels, tmp_path):
    house, venv, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "app"
    house.mkdir()
    work.mkdir()
    _wheelhouse(wheels["client"], house)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                    "--find-links", str(house), str(wheels["client"])], check=True, timeout=300)
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert "torch" not in installed and {"raincheck-client", "grpcio", "protobuf"} <= installed, installed

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    serve = subprocess.Popen([Path(sys.executable).parent / "raincheck", "serve", "--port", "0", "--metrics-port",
                              "-1"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if line.startswith("raincheck serving"):
                break
        found = re.search(r"serving (\S+) on (\S+)", lines[-1] if lines else "")
        assert found and found.group(1) == "demo", lines
        (work / "scene.png").write_bytes(random_scene(random.Random(0)).png())
        example = _readme_example().replace("127.0.0.1:50051", found.group(2))
        result = subprocess.run([python, "-c", example], cwd=work, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        answers = result.stdout.strip().splitlines()
        assert len(answers) == 2 and all(a.strip() for a in answers), result.stdout
    finally:
        serve.terminate()
        serve.wait(timeout=60)
