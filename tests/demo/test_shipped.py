"""The names of the shipped checkpoints (raincheck_core/models/shipped.py): "demo" is v2, "demo-v2" too,
"demo-v1" is v1; `$RAINCHECK_DEMO_MODEL` moves "demo" alone, `$RAINCHECK_MODELS_DIR` all of them; a
missing folder is a CheckpointError naming every name; any other string is a path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raincheck_core import CheckpointError, Engine
from raincheck_core.models import shipped
from raincheck_core.models.shipped import SHIPPED, resolve_model_path, shipped_folder
from services.common.model_loading import default_model, model_name
from services.common.settings import DemoSettings, ModelSpec, WorkerSettings

from .helpers import FOLDER, V2, needs_checkpoint, needs_v2


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    for variable in (shipped.MODELS_DIR_VARIABLE, *(m.variable for m in SHIPPED.values() if m.variable)):
        monkeypatch.delenv(variable, raising=False)


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_the_names_and_their_folders():
    assert list(SHIPPED) == ["demo", "demo-v2", "demo-v1"]
    assert shipped_folder("demo") == shipped_folder("demo-v2") == V2
    assert shipped_folder("demo-v1") == FOLDER


@needs_v2
@needs_checkpoint
def test_each_name_resolves_to_its_checkpoint():
    assert resolve_model_path("demo") == resolve_model_path("demo-v2") == V2
    assert resolve_model_path("demo-v1") == FOLDER


def test_any_other_string_is_a_path(tmp_path):
    for path in ("models/demo", "demo-v3", "./demo", str(tmp_path), tmp_path):
        assert resolve_model_path(path) == Path(path)


def test_the_demo_variable_moves_demo_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RAINCHECK_DEMO_MODEL", str(_folder(tmp_path / "mine")))
    assert resolve_model_path("demo") == tmp_path / "mine"
    assert shipped_folder("demo-v2") == V2 and shipped_folder("demo-v1") == FOLDER


def test_the_models_folder_variable_moves_every_name(tmp_path, monkeypatch):
    """What an installed wheel (no checkpoints in it) uses to find a copy of models/."""
    monkeypatch.setenv(shipped.MODELS_DIR_VARIABLE, str(tmp_path))
    _folder(tmp_path / "demo-v2")
    assert resolve_model_path("demo") == resolve_model_path("demo-v2") == tmp_path / "demo-v2"
    with pytest.raises(CheckpointError) as error:
        resolve_model_path("demo-v1")
    message = str(error.value)
    assert f"'demo-v1' is not at {tmp_path / 'demo'}" in message
    for name in SHIPPED:
        assert f"{name} -> {shipped_folder(name)}" in message
    assert f"demo-v2 -> {tmp_path / 'demo-v2'} (present)" in message and "python -m raincheck_demo.train" in message
    assert shipped.MODELS_DIR_VARIABLE in message


def test_without_the_checkpoints_the_default_is_a_random_model(tmp_path, monkeypatch):
    monkeypatch.setenv(shipped.MODELS_DIR_VARIABLE, str(tmp_path))
    assert default_model() is None
    with pytest.raises(CheckpointError, match="RAINCHECK_DEMO_MODEL"):
        Engine.from_pretrained("demo")


@needs_v2
def test_the_default_model_is_demo_which_is_v2():
    assert default_model() == "demo" and model_name(ModelSpec()) == "demo"
    assert resolve_model_path(default_model()) == V2


@needs_checkpoint
def test_v1_loads_by_its_name():
    by_name, by_folder = Engine.from_pretrained("demo-v1"), Engine.from_pretrained(FOLDER)
    vocab = json.loads((FOLDER / "config.json").read_text())["text_config"]["vocab_size"]
    assert by_name.model_config.vocab_size == by_folder.model_config.vocab_size == vocab
    assert vocab != json.loads((V2 / "config.json").read_text())["text_config"]["vocab_size"]


def test_settings_take_every_name_and_list_them_for_an_unknown_one():
    for name in SHIPPED:
        assert WorkerSettings(model=name).model == name
    with pytest.raises(ValueError, match=r"no checkpoint at demo-v9: .*shipped model: demo, demo-v2, demo-v1"):
        WorkerSettings(model="demo-v9")
    for settings in (ModelSpec, DemoSettings):
        assert f"({', '.join(SHIPPED)})" in settings.__pydantic_fields__["model"].description
