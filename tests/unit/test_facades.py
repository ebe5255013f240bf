"""The recipes' facades (finetune_kit.data, .models, .training) name each export twice: in ``_LAZY``, which loads
its module on first use, and under ``TYPE_CHECKING``, which editors, type checkers and import tracers read. The
two must agree, and every name must be what its module defines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
FACADES = ["finetune_kit.data", "finetune_kit.models", "finetune_kit.training"]


def static_exports(source: str) -> dict[str, str]:
    """name -> module of the ``from M import name`` lines under ``if TYPE_CHECKING:``."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for line in node.body:
                if isinstance(line, ast.ImportFrom):
                    found.update({alias.name: line.module for alias in line.names})
    return found


def lazy_exports(source: str) -> dict[str, str]:
    """The ``_LAZY`` table, evaluated from the source alone."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY" for t in node.targets):
            return eval(compile(ast.Expression(node.value), "<_LAZY>", "eval"), {"dict": dict})
    return {}


def mismatch(source: str) -> set[str]:
    static, lazy = static_exports(source), lazy_exports(source)
    return {f"{name}: {static.get(name)} / {lazy.get(name)}" for name in static.keys() | lazy.keys()
            if static.get(name) != lazy.get(name)}


@pytest.mark.parametrize("facade", FACADES)
def test_each_export_is_named_the_same_for_editors_and_at_run_time(facade):
    source = (SHARED / Path(*facade.split(".")) / "__init__.py").read_text()
    assert static_exports(source), f"{facade} has no TYPE_CHECKING imports"
    assert not mismatch(source)
    package = importlib.import_module(facade)
    for name, module in lazy_exports(source).items():
        assert getattr(package, name) is getattr(importlib.import_module(module), name)


def test_a_name_missing_from_either_list_is_caught():
    source = ('_LAZY = {**dict.fromkeys(("a", "b"), "m"), "c": "n"}\nif TYPE_CHECKING:\n'
              '    from m import a, b\n    from o import c\n    from m import d\n')
    assert mismatch(source) == {"c: o / n", "d: m / None"}
