"""`make test`: the same sessions as noxfile.py, and the image builds it runs ahead are reused."""

from __future__ import annotations

import ast
import re

from tests.container.podman import ran_a_step
from tests.harness import REPO


def test_make_test_runs_the_noxfile_sessions_in_their_order():
    tree = ast.parse((REPO / "noxfile.py").read_text())
    sessions = next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and ast.unparse(node.targets[0]) == "nox.options.sessions")
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    assert re.search(r"^TEST_SESSIONS := (.*)$", makefile, re.M).group(1).split() == sessions


CACHED = """STEP 1/4: FROM localhost/base:ci
STEP 2/4: ARG VERSION
STEP 3/4: RUN pip install .
--> Using cache 74f11c23860ef4fced0557f95c0dbb2d04f19a13816542a91dfeaba8b48899ca
--> 74f11c23860
STEP 4/4: COPY shared shared
--> Using cache 8bb0e54641cf37ff2b154fbee6b63b5ba0a9bc3083439e102b0f28243075c914
--> 8bb0e54641c
COMMIT localhost/x:ci
"""


def test_a_build_served_from_the_cache_is_told_from_one_that_ran():
    assert not ran_a_step(CACHED)
    ran_pip = CACHED.replace("--> Using cache 74f11c23860ef4fced0557f95c0dbb2d04f19a13816542a91dfeaba8b48899ca\n", "")
    assert ran_a_step(ran_pip)
    assert ran_a_step(CACHED.replace("--> Using cache 8bb0e5", "--> 8bb0e5"))  # a COPY of changed files


# make test-quick: what a quick test of a recipe file may ask for (the module's main run, started by the README's
# command, and what it reads), so that the tier launches each recipe once (make demo and make eval aside)
RECIPES = sorted(folder for folder in (REPO / "recipes").iterdir() if (folder / "train.py").is_file())
MAIN_RUN = {"fresh_launch", "made", "run", "run_info", "tiny_llama2", "tiny_llama3", "tmp_path"}


def quick_tests(path) -> dict[str, set[str]]:
    tree = ast.parse(path.read_text())
    return {node.name: {arg.arg for arg in node.args.args} for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(ast.unparse(d) == "pytest.mark.quick" for d in node.decorator_list)}


def test_make_test_quick_runs_lint_the_unit_tests_and_the_readme_commands():
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^test-quick:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    sessions = re.findall(r"\$\(NOX\) -s ([\w-]+)", recipe)
    assert sessions == ["lint", "stack", "ops", "ops", "readme-commands", "unit"]
    noxfile = (REPO / "noxfile.py").read_text()
    sessions = noxfile.split("RECIPE_SESSIONS = {")[1].split("}")[0]  # QUICK_FILES: a file for each of these
    assert all(f'"{recipe.name}":' in sessions for recipe in RECIPES)


def test_each_recipes_quick_tests_read_only_its_main_run():
    """The tests marked quick in each recipe's test file ask for the module's main run (the README's command) and
    what it wrote, never a fixture that launches again; and every recipe has them, the main run's own first."""
    for recipe in RECIPES:
        path = REPO / f"tests/recipes/test_{recipe.name.replace('-', '_')}.py"
        quick = quick_tests(path)
        assert quick, f"{path.name}: no test marked quick"
        for name, fixtures in quick.items():
            assert fixtures <= MAIN_RUN, f"{path.name}::{name} asks for {sorted(fixtures - MAIN_RUN)}"
        assert {"fresh_launch", "made", "run"} & set().union(*quick.values())


def test_the_quick_check_bites_on_a_test_that_launches_again(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text("import pytest\n\n@pytest.mark.quick\ndef test_a(run, recipe_copy):\n    pass\n")
    assert not quick_tests(test)["test_a"] <= MAIN_RUN
