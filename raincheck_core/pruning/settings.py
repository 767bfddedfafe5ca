"""Per-model selector options shipped with a checkpoint (docs/selectors.md §5).

Some selector hyperparameters are calibrated per vision encoder (HiPrune's object and deep layers). A
checkpoint folder may carry the calibrated values in `selector_options.json`, {selector name: {option:
value}}. `Engine.from_pretrained` loads them and applies them to every turn whose `DeferralConfig` names
that selector without options of its own (`Engine.deferral_for`; explicit options win). A folder without
the file uses every selector's defaults (the published settings).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, InvalidInputError

SELECTOR_OPTIONS_FILE = "selector_options.json"


def _checked(options: object, where: str) -> dict[str, dict]:
    """`options` if it is {selector name: {option: value}} and every selector builds with its options."""
    from . import get_selector

    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise CheckpointError(f"{where}: expected {{selector name: {{option: value}}}}")
    for name, opts in options.items():
        try:
            get_selector(name, **opts)
        except InvalidInputError as e:
            raise CheckpointError(f"{where}: {e}") from e
    return options


def load_selector_options(model_dir: str | Path) -> dict[str, dict]:
    """The folder's calibrated options per selector name ({} without the file), checked by building each
    selector once, so a bad file fails at load and not in a session's first turn."""
    path = Path(model_dir) / SELECTOR_OPTIONS_FILE
    if not path.is_file():
        return {}
    try:
        return _checked(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def save_selector_options(model_dir: str | Path, options: dict[str, dict]) -> Path:
    path = Path(model_dir) / SELECTOR_OPTIONS_FILE
    path.write_text(json.dumps(_checked(options, str(path)), indent=1, sort_keys=True) + "\n")
    return path
