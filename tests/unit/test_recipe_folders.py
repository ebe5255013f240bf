"""Every recipe folder works on its own: copied out of the repository, its train.py runs with only
the installed package, and it stays a short script over a handful of the package's names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys

import pytest

from tests.harness import REPO

RECIPES = sorted(p.parent for p in (REPO / "recipes").glob("*/train.py"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_copied_recipe_runs_with_only_the_installed_package(recipe, tmp_path):
    copy = shutil.copytree(recipe, tmp_path / recipe.name)
    where = subprocess.run([sys.executable, "-c", "import finetune_kit; print(finetune_kit.__file__)"],
                           cwd=copy, capture_output=True, text=True, check=True).stdout.strip()
    assert not where.startswith(str(REPO / "shared")), f"{where}: install the package (pip install .), not a path"
    help_text = subprocess.run([sys.executable, "train.py", "--help"], cwd=copy, capture_output=True, text=True,
                               timeout=120)
    assert help_text.returncode == 0, help_text.stderr[-3000:]
    assert "--model" in help_text.stdout and "--data" in help_text.stdout


def package_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune_kit"):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("finetune_kit"))
    return names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_recipe_is_a_short_script_over_a_few_package_names(recipe):
    """The bookkeeping lives in the package (finetune_kit.training): a recipe keeps its flags, data, model and
    loop, readable top to bottom, with the launch command in its docstring."""
    source = (recipe / "train.py").read_text()
    tree = ast.parse(source)
    assert "launch" in (ast.get_docstring(tree) or "") or "deepspeed --num_gpus" in ast.get_docstring(tree)
    names = package_names(tree)
    assert len(names) <= 8, sorted(names)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 80, f"main() is {main.end_lineno - main.lineno + 1} lines"
    assert len(source.splitlines()) <= 185  # the 70B: 15 flags of its own in its Arguments
