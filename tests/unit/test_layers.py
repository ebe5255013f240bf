"""Every import in the package points down the stack: a module uses its own package and the layers
below it, never one above (function-level imports included). The recipes' facade,
``finetune_kit/__init__.py``, stands on top and may use anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "shared/finetune_kit"
# bottom to top; one rank may hold several packages, which then must not use each other
LAYERS = [
    ("errors",),
    ("outputs", "output_lock", "tables"),
    ("data",),
    ("models",),
    ("launch",),
    ("metering",),
    ("planning",),  # its speed model counts FLOPs as the meter does (metering.flops)
    ("check",),
    ("repo",),
    ("results",),
    ("training", "gpu_check"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def part_of(module: str) -> str | None:
    """``finetune_kit.launch.env`` -> ``launch``; None for the facade or anything outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "finetune_kit" and len(parts) > 1 else None


def imports(path: Path, package: Path) -> list[tuple[int, str]]:
    here = "finetune_kit." + ".".join(path.relative_to(package).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here.split(".")[: -node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "finetune_kit":  # from finetune_kit import outputs
                out += [(node.lineno, f"finetune_kit.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, module))
    return out


def upward_imports(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package)
        own = where.parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        if own not in RANK:
            found.append(f"{where}: '{own}' is in no layer of this test")
            continue
        for line, module in imports(path, package):
            other = part_of(module)
            if other is None or other == own:
                continue
            if other not in RANK:
                found.append(f"{where}:{line} imports '{other}', in no layer of this test")
            elif RANK[other] >= RANK[own]:
                found.append(f"{where}:{line} imports {module} (layer {RANK[other]}, "
                             f"'{own}' is layer {RANK[own]})")
    return found


def test_every_import_points_down():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path):
    fake = tmp_path / "finetune_kit"
    (fake / "data").mkdir(parents=True)
    (fake / "data" / "rows.py").write_text("def f():\n    from finetune_kit.results.record import RunRecord\n")
    (fake / "results").mkdir()
    (fake / "results" / "record.py").write_text("from finetune_kit.data import rows\n")
    assert upward_imports(fake) == [
        f"data/rows.py:2 imports finetune_kit.results.record (layer {RANK['results']}, 'data' is layer {RANK['data']})"]


@pytest.mark.parametrize("module,part", [("finetune_kit.launch.env", "launch"), ("finetune_kit", None),
                                         ("torch.nn", None)])
def test_part_of(module, part):
    assert part_of(module) == part
