"""Shared fixtures: tiny models built once per test session, recipe copies, a recipe's main() in-process."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.harness import REPO, SAMPLE  # noqa: F401  (the names tests import from here)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> Path:
    from finetune_kit.models.tiny import build_tiny

    return build_tiny("llama3", tmp_path_factory.mktemp("models") / "tiny-llama3")


@pytest.fixture(scope="session")
def tiny_llama2(tmp_path_factory) -> Path:
    from finetune_kit.models.tiny import build_tiny

    return build_tiny("llama2", tmp_path_factory.mktemp("models") / "tiny-llama2")


@pytest.fixture(scope="module")
def recipe_copy(request, tmp_path_factory) -> Path:
    """The test module's RECIPE folder copied outside the repository, as a user would copy it."""
    recipe = request.module.RECIPE
    dest = tmp_path_factory.mktemp("user") / recipe.name
    shutil.copytree(recipe, dest)
    return dest


@pytest.fixture
def recipe_main(request, monkeypatch):
    """The test module's recipe ``main()`` in-process, as a launcher starts one rank: from the
    recipe folder, with the module's ``LAUNCH_ENV`` (e.g. the DeepSpeed JSON accelerate passes).
    For the checks that run before any process group."""
    recipe = request.module.RECIPE
    monkeypatch.chdir(recipe)
    for key, value in getattr(request.module, "LAUNCH_ENV", {}).items():
        monkeypatch.setenv(key, value)
    return load_script(recipe / "train.py").main


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write rows as JSON lines; return the path as a string (what --data takes)."""
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_script(path: Path):
    """Import a recipe's train.py as a module (recipes are folders, not packages)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{path.parent.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
