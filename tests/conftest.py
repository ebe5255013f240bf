"""Shared fixtures: tiny models are built once per test session, from the shipped sample."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "shared/finetune_kit/sample_data/instructions.jsonl"


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> Path:
    from finetune_kit.tiny import build_tiny

    return build_tiny("llama3", tmp_path_factory.mktemp("models") / "tiny-llama3")


@pytest.fixture(scope="session")
def tiny_llama2(tmp_path_factory) -> Path:
    from finetune_kit.tiny import build_tiny

    return build_tiny("llama2", tmp_path_factory.mktemp("models") / "tiny-llama2")


@pytest.fixture(scope="module")
def recipe_copy(request, tmp_path_factory) -> Path:
    """The test module's RECIPE folder copied outside the repository, as a user would copy it."""
    recipe = request.module.RECIPE
    dest = tmp_path_factory.mktemp("user") / recipe.name
    shutil.copytree(recipe, dest)
    return dest


def installed_package_location(cwd: Path) -> Path:
    """Where ``import finetune_kit`` resolves from ``cwd`` (a copied recipe must not see shared/)."""
    where = subprocess.run([sys.executable, "-c", "import finetune_kit; print(finetune_kit.__file__)"],
                           cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    return Path(where)


def read_metrics(output: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write rows as JSON lines; return the path as a string (what --data takes)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_script(path: Path):
    """Import a recipe's train.py as a module (recipes are folders, not packages)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{path.parent.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's --master_port (29500 may be taken)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
