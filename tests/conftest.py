"""Shared fixtures: tiny models built once per test session, recipe copies, a recipe's main() in-process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import launch_times
from tests.harness import REPO, load_script

_CLOCK = launch_times.LaunchClock()


def pytest_sessionstart(session):
    if launch_times.session_name():
        _CLOCK.install()


def pytest_sessionfinish(session):
    """In a make test session: its launches and their steps' seconds into .nox/launches.jsonl (launch_times.py)."""
    if name := launch_times.session_name():
        _CLOCK.uninstall()
        factory = getattr(session.config, "_tmp_path_factory", None)
        launch_times.record(REPO, name, _CLOCK, factory.getbasetemp() if factory else Path("/nonexistent"))


@pytest.fixture(scope="session", autouse=True)
def token_cache_of_this_session(tmp_path_factory):
    """Tokenised data is cached in the session's own folder (the recipes' default is the user's
    ~/.cache): the launched ranks inherit it."""
    import os

    folder = tmp_path_factory.mktemp("finetune-cache")
    old = os.environ.get("FINETUNE_CACHE_DIR")
    os.environ["FINETUNE_CACHE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("FINETUNE_CACHE_DIR", None)
    else:
        os.environ["FINETUNE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> Path:
    from finetune_tools.tiny_models import build_tiny

    return build_tiny("llama3", tmp_path_factory.mktemp("models") / "tiny-llama3")


@pytest.fixture(scope="session")
def tiny_llama3_4bit(tiny_llama3, tmp_path_factory) -> Path:
    """tiny_llama3 saved in 4-bit (nf4, stored as bf16), as a ``*-bnb-4bit`` folder is."""
    from finetune_tools.tiny_models import save_4bit

    return save_4bit(tiny_llama3, tmp_path_factory.mktemp("models") / "tiny-llama3-bnb-4bit")


@pytest.fixture(scope="session")
def tiny_llama2(tmp_path_factory) -> Path:
    from finetune_tools.tiny_models import build_tiny

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
    # a long-context launch sets the CUDA allocator's variable in its own process: here, the test's, undone after it
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # remembers the value before, restored after the test
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    return load_script(recipe / "train.py").main
