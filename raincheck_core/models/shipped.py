"""Names of the checkpoints this project ships, resolved to their folders."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint folder; the name "demo" means the model this project trains and ships
    (`models/demo/` in the repository, or `$RAINCHECK_DEMO_MODEL`)."""
    if str(path) != "demo":
        return Path(path)
    folder = Path(os.environ.get("RAINCHECK_DEMO_MODEL", Path(__file__).resolve().parents[2] / "models" / "demo"))
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"the demo model is not at {folder}: train it with "
                              "`python -m raincheck_demo.train` or set RAINCHECK_DEMO_MODEL")
    return folder
