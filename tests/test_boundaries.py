"""Package boundaries, read from the source: the services, benchmarks and the demo model's package use
raincheck_core's public surface only, raincheck_core imports nothing from services or the demo package and
holds no training code, and deferral/ does not reach into engine/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "_gen" not in p.parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_in(path: Path) -> set[str]:
    """Private names a module defines: functions, classes, globals, arguments and `self._x` attributes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _private_definitions(package: str) -> set[str]:
    """Private names a package defines (in any of its modules)."""
    return set().union(*(_defined_in(p) for p in _sources(package)))


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every import in a file under ROOT."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.append((module, [a.name for a in node.names]))
    return out


def _crossings(package: str) -> list[str]:
    """Uses of raincheck_core's private names from `package`: imported by name, or read as an attribute
    (`engine._step_failed`) where `package` defines no such name itself."""
    core = _private_definitions("raincheck_core") - _private_definitions(package)
    found = []
    for path in _sources(package):
        where = path.relative_to(ROOT)
        for module, names in _imports(path):
            if module.startswith("raincheck_core"):
                found += [f"{where}: imports {module}.{n}" for n in names if _private(n)]
                found += [f"{where}: imports {module}" for part in module.split(".") if _private(part)]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in core:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_services_use_only_public_names_of_the_engine():
    assert _crossings("services") == []


def test_benchmarks_use_only_public_names_of_the_engine():
    assert _crossings("bench") == []


def test_the_demo_package_uses_only_public_names_of_the_engine():
    assert _crossings("raincheck_demo") == []


def test_the_engine_library_imports_nothing_from_services():
    for path in _sources("raincheck_core"):
        for module, _ in _imports(path):
            assert not module.startswith(("services", "grpc", "ray", "redis")), (path, module)


def test_the_engine_library_holds_no_training_code():
    """The demo model's world, data and training are the repository's raincheck_demo package."""
    for path in _sources("raincheck_core"):
        for module, _ in _imports(path):
            assert not module.startswith(("raincheck_demo", "torch.optim", "tqdm")), (path, module)
        assert ".backward(" not in path.read_text(), path


def test_deferral_does_not_import_the_engine():
    for path in _sources("raincheck_core/deferral"):
        for module, names in _imports(path):
            assert not module.startswith("raincheck_core.engine"), (path, module, names)


def test_subpackages_of_the_engine_library_share_no_private_names():
    for path in _sources("raincheck_core"):
        own = ".".join(path.relative_to(ROOT).parts[:2])          # raincheck_core.<subpackage>
        for module, names in _imports(path):
            if module.startswith("raincheck_core") and not module.startswith(own):
                assert not [n for n in names if _private(n)], (path, module, names)


def _module_crossings(package: str) -> list[str]:
    """Within `package`: a private name one module uses (imported by name, `TYPE_CHECKING` imports
    included, or read as an attribute) that another of its modules defines and this one does not."""
    paths = _sources(package)
    defined = {p: _defined_in(p) for p in paths}
    found = []
    for path in paths:
        where = path.relative_to(ROOT)
        others = set().union(*(d for p, d in defined.items() if p != path)) - defined[path]
        for module, names in _imports(path):
            if module.startswith(package.replace("/", ".")):
                found += [f"{where}: imports {module}.{n}" for n in names if _private(n)]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in others:
                found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_of_the_engine_library_uses_another_modules_private_names():
    assert _module_crossings("raincheck_core") == []


def test_no_engine_module_imports_the_facade():
    for path in _sources("raincheck_core/engine"):
        if path.name in ("engine.py", "__init__.py"):
            continue
        for module, names in _imports(path):
            assert module != "raincheck_core.engine.engine", (path, names)
            assert not (module == "raincheck_core.engine" and "engine" in names), (path, names)


def test_the_module_check_catches_a_private_crossing(tmp_path, monkeypatch):
    (tmp_path / "raincheck_core").mkdir()
    (tmp_path / "raincheck_core" / "engine.py").write_text("class E:\n    def _fail(self): ...\n")
    (tmp_path / "raincheck_core" / "step.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from raincheck_core.engine import _Hidden\n\n"
        "def f(engine):\n    engine._fail()\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    found = _module_crossings("raincheck_core")
    assert any("_Hidden" in f for f in found) and any("._fail" in f for f in found)
    assert not any(f.startswith("raincheck_core/engine.py") for f in found)


def test_the_check_catches_a_private_crossing(tmp_path, monkeypatch):
    (tmp_path / "raincheck_core").mkdir()
    (tmp_path / "raincheck_core" / "engine.py").write_text("class E:\n    def _fail(self): ...\n")
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "worker.py").write_text(
        "from raincheck_core.engine import _helper\n\ndef f(engine):\n    engine._fail()\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    found = _crossings("services")
    assert any("_helper" in f for f in found) and any("._fail" in f for f in found)


ENGINE_INTERNALS = ("core", "scheduler", "stepper")
# every package but the tests: they may read an engine's internals, nothing else may
OUTSIDE_THE_ENGINE = ("services", "bench", "raincheck_demo", "raincheck_client", "raincheck_core")


def _engine_internals(packages: tuple[str, ...] = OUTSIDE_THE_ENGINE) -> list[str]:
    """Reads of `.core`, `.scheduler` or `.stepper` (an engine's internals: `Engine` offers getters for what
    they are read for) anywhere in `packages` but raincheck_core/engine/ itself."""
    found = []
    for package in packages:
        for path in _sources(package):
            where = path.relative_to(ROOT)
            if where.parts[:2] == ("raincheck_core", "engine"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_nothing_outside_the_engine_reads_its_core_scheduler_or_stepper():
    assert _engine_internals() == []


def test_the_internals_check_catches_a_read(tmp_path, monkeypatch):
    (tmp_path / "raincheck_core" / "engine").mkdir(parents=True)
    (tmp_path / "raincheck_core" / "engine" / "engine.py").write_text(
        "class Engine:\n    def step(self):\n        return self.stepper.step()\n")
    (tmp_path / "raincheck_core" / "warmup.py").write_text("def f(engine):\n    return engine.scheduler.cost\n")
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "worker.py").write_text("def f(engine):\n    return engine.core.max_model_len\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "timing.py").write_text("def f(e):\n    e.stepper.wake()\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert sorted(_engine_internals(("services", "bench", "raincheck_core"))) == [
        "bench/timing.py:2: .stepper", "raincheck_core/warmup.py:2: .scheduler", "services/worker.py:2: .core"]


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (anywhere in the file: in functions and under
    `TYPE_CHECKING` too). `from a import b` counts as importing the module `a.b` where that is a module."""
    modules = {_module_of(p): p for p in _sources(package)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for module, names in _imports(path):
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(package: str) -> list[list[str]]:
    """The strongly connected components of more than one module in `package`'s import graph (Tarjan)."""
    graph = _import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_engine_library_has_no_import_cycle():
    assert import_cycles("raincheck_core") == []


def test_the_services_have_no_import_cycle():
    assert import_cycles("services") == []


def test_the_cycle_check_finds_a_typing_only_cycle(tmp_path, monkeypatch):
    (tmp_path / "raincheck_core" / "engine").mkdir(parents=True)
    (tmp_path / "raincheck_core" / "engine" / "core.py").write_text("from .step import run_step\n")
    (tmp_path / "raincheck_core" / "engine" / "step.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import EngineCore\n")
    (tmp_path / "raincheck_core" / "engine" / "plan.py").write_text("from . import step\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert import_cycles("raincheck_core") == [["raincheck_core.engine.core", "raincheck_core.engine.step"]]


SESSION_MODULES = {"raincheck_core.engine.session", "raincheck_core.engine.session_cache",
                   "raincheck_core.engine.request", "raincheck_core.engine.core",
                   "raincheck_core.engine.scheduler", "raincheck_core.engine.update"}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_runner_reaches_no_session_object():
    """Its inputs are the plan and the pools: neither it nor anything it imports (typing imports included)
    can name a session, a turn or the core that holds them."""
    graph = _import_graph("raincheck_core")
    for stage in ("raincheck_core.engine.runner", "raincheck_core.engine.graphs"):
        assert _reachable(graph, stage) & SESSION_MODULES == set(), stage
