"""Every import in the package points down the stack: a module uses its own package and the layers
below it, never one above (function-level imports included). The recipes' facade,
``finetune_kit/__init__.py``, stands on top and may use anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
PACKAGE = SHARED / "finetune_kit"  # the runtime: what a recipe imports when it runs
TOOLS = SHARED / "tools/finetune_tools"  # the tools over the repository; may use the runtime, never the reverse
# bottom to top; one rank may hold several packages, which then must not use each other
LAYERS = [
    ("errors", "caches", "command_line"),  # caches: what the kit reuses between launches; command_line: argparse
    ("outputs", "output_lock", "model_card"),  # model_card: a saved folder's README.md, from the run's files
    ("losses",),  # the labels that take no loss, the step's count and scale, the causal LM's and classifier's loss
    ("data",),
    ("models",),
    ("launch",),
    ("metering",),
    ("planning",),  # the memory check: model shapes, the launched configs
    ("check",),
    ("training",),
]
TOOL_LAYERS = [
    ("harness", "merge"),  # python -m finetune_tools.harness / .merge (make eval, make merge): the runtime alone
    ("paths", "tables", "tiny_models", "samples", "deepspeed_configs"),
    ("planning",),
    ("repo",),  # the README blocks hold the planner's tables
    ("gpu_check",),
    ("results",),  # the speed calibration fits the planner's model; the page lists the GPU check's ablation
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
TOOL_RANK = {name: rank for rank, names in enumerate(TOOL_LAYERS) for name in names}


def part_of(module: str, name: str = "finetune_kit") -> str | None:
    """``finetune_kit.launch.env`` -> ``launch``; None for the facade or anything outside package ``name``."""
    parts = module.split(".")
    return parts[1] if parts[0] == name and len(parts) > 1 else None


def imports(path: Path, package: Path) -> list[tuple[int, str]]:
    here = f"{package.name}." + ".".join(path.relative_to(package).with_suffix("").parts)
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
            if module in ("finetune_kit", "finetune_tools"):  # from finetune_kit import outputs
                out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, module))
    return out


def upward_imports(package: Path = PACKAGE, rank: dict = RANK) -> list[str]:
    """Imports of ``package`` that point to its own layer's neighbours or above; for the runtime, any of the
    tools package too."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package)
        own = where.parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        if own not in rank:
            found.append(f"{where}: '{own}' is in no layer of this test")
            continue
        for line, module in imports(path, package):
            if package.name == "finetune_kit" and module.split(".")[0] == "finetune_tools":
                found.append(f"{where}:{line} imports {module}: the runtime never uses the tools")
                continue
            other = part_of(module, package.name)
            if other is None or other == own:
                continue
            if other not in rank:
                found.append(f"{where}:{line} imports '{other}', in no layer of this test")
            elif rank[other] >= rank[own]:
                found.append(f"{where}:{line} imports {module} (layer {rank[other]}, "
                             f"'{own}' is layer {rank[own]})")
    return found


def test_every_import_points_down():
    assert upward_imports() == []


def test_every_import_of_the_tools_points_down_or_into_the_runtime():
    assert upward_imports(TOOLS, TOOL_RANK) == []


@pytest.mark.parametrize("package,rank", [(PACKAGE, RANK), (TOOLS, TOOL_RANK)], ids=["runtime", "tools"])
def test_every_layer_names_a_part_of_its_package(package, rank):
    """A part that moved (to the other package, or away) leaves no stale name in the layers above."""
    assert [name for name in rank if not (package / name).is_dir() and not (package / f"{name}.py").is_file()] == []


def test_the_check_sees_an_upward_import_and_the_runtime_using_a_tool(tmp_path):
    fake = tmp_path / "finetune_kit"
    (fake / "data").mkdir(parents=True)
    (fake / "data" / "rows.py").write_text("def f():\n    from finetune_kit.metering.run_record import RunRecord\n")
    (fake / "metering").mkdir()
    (fake / "metering" / "run_record.py").write_text("from finetune_kit.data import rows\n"
                                                     "from finetune_tools.results import report\n")
    assert upward_imports(fake) == [
        f"data/rows.py:2 imports finetune_kit.metering.run_record (layer {RANK['metering']}, "
        f"'data' is layer {RANK['data']})",
        "metering/run_record.py:2 imports finetune_tools.results: the runtime never uses the tools"]


@pytest.mark.parametrize("module,part", [("finetune_kit.launch.env", "launch"), ("finetune_kit", None),
                                         ("torch.nn", None)])
def test_part_of(module, part):
    assert part_of(module) == part
