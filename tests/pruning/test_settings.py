"""Per-model selector options shipped with a checkpoint folder (raincheck_core/pruning/settings.py)."""

from __future__ import annotations

import pytest

from raincheck_core.errors import CheckpointError
from raincheck_core.pruning.settings import SELECTOR_OPTIONS_FILE, load_selector_options, save_selector_options


def test_a_folder_without_the_file_uses_the_defaults(tmp_path) -> None:
    assert load_selector_options(tmp_path) == {}


def test_options_round_trip(tmp_path) -> None:
    options = {"hiprune": {"object_layer": "last", "deep_layer": "middle"}}
    assert save_selector_options(tmp_path, options).name == SELECTOR_OPTIONS_FILE
    assert load_selector_options(tmp_path) == options


@pytest.mark.parametrize("text", ["{not json", '["hiprune"]', '{"hiprune": {"beta": 1}}', '{"fastv": {}}'])
def test_a_bad_file_fails_at_load(tmp_path, text: str) -> None:
    (tmp_path / SELECTOR_OPTIONS_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=SELECTOR_OPTIONS_FILE):
        load_selector_options(tmp_path)


def test_a_bad_option_is_not_written(tmp_path) -> None:
    with pytest.raises(CheckpointError):
        save_selector_options(tmp_path, {"hiprune": {"beta": 1}})
    assert not (tmp_path / SELECTOR_OPTIONS_FILE).exists()
