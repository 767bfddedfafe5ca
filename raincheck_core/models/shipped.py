"""The checkpoints this project ships, by name: a small table of names and the folders they stand for.

`Engine.from_pretrained("demo")` (and `--model demo`, `RAINCHECK_MODEL=demo`) loads the folder the name
stands for; any other string is a path. The folders live under the models folder: `$RAINCHECK_MODELS_DIR`,
else `models/` next to the installed `raincheck_core` — the repository's `models/` in a checkout, an
editable install and the Docker image (which is one, at /app). A wheel installs no checkpoints, so there
the names resolve only with `$RAINCHECK_MODELS_DIR` (or a name's own variable) pointing at a copy.

The checkpoints' world, tokenizer and training are the repository's `raincheck_demo` package; the engine
library knows only the folders.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

MODELS_DIR_VARIABLE = "RAINCHECK_MODELS_DIR"
TRAIN_COMMAND = "python -m raincheck_demo.train"


@dataclass(frozen=True)
class ShippedModel:
    folder: str                      # under the models folder
    about: str                       # one line, for errors and listings
    variable: str | None = None      # an environment variable that names another folder for this name


SHIPPED: dict[str, ShippedModel] = {
    "demo": ShippedModel("demo-v2", "the demo model (its latest version, v2)", variable="RAINCHECK_DEMO_MODEL"),
    "demo-v2": ShippedModel("demo-v2", "v2 of the demo model: images at any turn and short videos"),
    "demo-v1": ShippedModel("demo", "v1 of the demo model: one image with the first question"),
}


def register(name: str, model: ShippedModel) -> None:
    """Add a name (another package's checkpoint); a name already in the table is not replaced."""
    if name in SHIPPED:
        raise ValueError(f"{name!r} already names a shipped model ({SHIPPED[name].folder})")
    SHIPPED[name] = model


def models_dir() -> Path:
    """Where the shipped checkpoints' folders are."""
    return Path(os.environ.get(MODELS_DIR_VARIABLE) or Path(__file__).resolve().parents[2] / "models")


def shipped_folder(name: str) -> Path:
    """The folder a shipped model's name stands for (present or not); KeyError for any other name."""
    model = SHIPPED[name]
    override = os.environ.get(model.variable) if model.variable else None
    return Path(override) if override else models_dir() / model.folder


def _present(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint folder: the folder of a shipped model's name (`SHIPPED`), or the path itself."""
    name = str(path)
    if name not in SHIPPED:
        return Path(path)
    folder = shipped_folder(name)
    if _present(folder):
        return folder
    variable = SHIPPED[name].variable
    known = ", ".join(f"{n} -> {shipped_folder(n)} ({'present' if _present(shipped_folder(n)) else 'missing'})"
                      for n in SHIPPED)
    raise CheckpointError(
        f"the shipped model {name!r} is not at {folder} (no config.json there). Known names: {known}. "
        f"Train the demo model with `{TRAIN_COMMAND}`, set {MODELS_DIR_VARIABLE} to a folder holding the "
        f"shipped checkpoints{f' (or {variable} to this one)' if variable else ''}, or give a checkpoint folder")
