"""Fixtures for the deployment checks: the manifest validator (scripts/validate_manifests.py) and the
rendered overlays, rendered once per session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_validator() -> ModuleType:
    name = "validate_manifests"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "validate_manifests.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def vm() -> ModuleType:
    return load_validator()


@pytest.fixture(scope="session")
def rendered(vm: ModuleType) -> dict[str, list[dict]]:
    """Overlay or example name -> its rendered documents (kubectl kustomize when present, else Python)."""
    return {path.name: vm.render(path) for path in vm.kustomizations()}
