"""The server distribution, `raincheck-serve` (metadata in pyproject.toml; this file adds what a static
table cannot say).

- Packages: `raincheck_core` (with the C sources of its native kernels, built on first use),
  `raincheck_demo` (the demo model's world, tokenizer and training: `raincheck demo` plays its
  dialogues), and the repository's `services/` installed as `raincheck_serve` (no generic top-level name
  in site-packages; services import each other relatively, so the code is the same under either name).
  `bench/` and `tests/` are tools of the repository and are not installed, nor are the checkpoints in
  `models/` (raincheck_core/models/shipped.py: where an installed server finds them).
- Dependencies: requirements/runtime.txt (one source for the metadata and for scripts/setup.sh), plus the
  client SDK of the same version (raincheck_client/pyproject.toml, a distribution of its own); the extra
  `accel` (requirements/accel.txt): fla's GDN kernels and Triton, for a GPU (`--backend fla`).
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def read_requirements(name: str) -> list[str]:
    return [line.strip() for line in (ROOT / "requirements" / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")]


requirements = read_requirements("runtime.txt")

setup(
    packages=[*find_packages(include=["raincheck_core", "raincheck_core.*", "raincheck_demo", "raincheck_demo.*"]),
              "raincheck_serve", *(f"raincheck_serve.{p}" for p in find_packages("services"))],
    package_dir={"raincheck_serve": "services"},
    package_data={"raincheck_serve._gen": ["*.pyi"], "raincheck_core.ops": ["csrc/*.c", "csrc/*.h"]},
    install_requires=[*requirements, f"raincheck-client=={version}"],
    extras_require={"accel": read_requirements("accel.txt")},
)
