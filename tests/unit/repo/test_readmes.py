"""The generated blocks of the recipe READMEs (memory table, DeepSpeed knobs) and finding the repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from finetune_kit.errors import UserInputError
from finetune_tools.paths import find_root
from finetune_tools.repo import readmes
from finetune_tools.repo.__main__ import main
from tests.harness import REPO

RECIPES = sorted(p.parent for p in (REPO / "recipes").glob("*/train.py"))
# the accelerate recipes: their Method table, one per --peft
TAKES_PEFT = {"llama3-8b-zero3", "llama3-70b-qlora", "llama3-70b-qlora-chat"}


def test_committed_readmes_are_current():
    assert readmes.update(REPO, check=True) == [], "run `make readmes` and commit the result"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_readme_has_both_generated_blocks(recipe):
    """Memory, speed and DeepSpeed knobs in every recipe; the long-context table where memory_plan.json has
    long-context setups (the 8B recipe); the Method table in the recipes that take --peft."""
    text = (recipe / "README.md").read_text()
    assert (recipe / "memory_plan.json").is_file()
    assert readmes.begin("memory-plan", "memory_plan.json") in text and readmes.end("memory-plan") in text
    found = [m["name"] for m in readmes.BEGIN_RE.finditer(text)]
    long_context = ["long-context-plan"] if "long_context" in json.loads((recipe / "memory_plan.json").read_text()) \
        else []
    method = ["method-plan"] if recipe.name in TAKES_PEFT else []
    assert sorted(found) == sorted(["deepspeed-knobs", "memory-plan", "speed-plan", *long_context, *method])


def test_every_note_explains_a_key_some_recipe_config_has():
    used = set()
    for config in (REPO / "recipes").glob("*/configs/*.json"):
        used |= set(readmes.flatten(readmes.read_config(config)))
    notes = readmes.load_notes(REPO / readmes.NOTES)
    assert sorted(set(notes) - used) == [], "notes for keys no config has: remove them"


@pytest.fixture
def repo_copy(tmp_path):
    """The 8B recipe and the notes file, copied: a repository root with one recipe."""
    shutil.copytree(REPO / "recipes/llama3-8b-zero3", tmp_path / "recipes/llama3-8b-zero3")
    shutil.copy(REPO / readmes.NOTES, tmp_path / readmes.NOTES)
    return tmp_path


def edit_config(root, change):
    path = root / "recipes/llama3-8b-zero3/configs/zero3.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=2))


def test_a_config_key_without_a_note_is_an_error_naming_it(repo_copy):
    edit_config(repo_copy, lambda c: c["zero_optimization"].update(round_robin_gradients=True))
    with pytest.raises(UserInputError, match=r"'zero_optimization\.round_robin_gradients' has no note in "
                                             r".*recipes/deepspeed-knobs\.json"):
        readmes.update(repo_copy, check=True)


def test_an_auto_value_needs_a_note_saying_what_fills_it(repo_copy):
    edit_config(repo_copy, lambda c: c["zero_optimization"].update(sub_group_size="auto"))
    with pytest.raises(UserInputError, match=r"'zero_optimization\.sub_group_size' is \"auto\" but its note"):
        readmes.update(repo_copy, check=True)


def test_knob_table_shows_values_as_written_and_the_optimizer_as_one_row():
    table = readmes.knob_table(REPO / "recipes/llama3-8b-zero3", "configs/zero3.json", REPO / readmes.NOTES)
    assert "| `zero_optimization.sub_group_size` | `1e9` |" in table
    assert "| `optimizer` | `AdamW`: lr `auto`, betas `[0.9, 0.95]`, eps `1e-8`, weight_decay `auto` |" in table
    assert "| `zero_optimization.reduce_bucket_size` | `auto` | " in table and "hidden_size²" in table
    assert "`optimizer.params" not in table
    # the offload config appears only with the keys it changes
    assert "| `configs/zero3-offload.json` | `zero_optimization.offload_optimizer.device` | `cpu` |" in table
    assert "| `configs/zero3-offload.json` | `bf16.enabled`" not in table


def test_a_stale_block_is_found_and_rewritten(repo_copy):
    readme = repo_copy / "recipes/llama3-8b-zero3/README.md"
    edit_config(repo_copy, lambda c: c["zero_optimization"].update(sub_group_size=5e8))
    text = readme.read_text()
    memory_begin = readmes.begin("memory-plan", "memory_plan.json")
    text = text.replace(memory_begin, memory_begin + "\ntyped by hand", 1)
    readme.write_text(text)

    assert readmes.update(repo_copy, check=True) == [readme]
    assert readme.read_text() == text  # --check changes nothing
    assert main(["readmes", "--root", str(repo_copy), "--check"]) == 1

    assert readmes.update(repo_copy, check=False) == [readme]
    new = readme.read_text()
    assert "typed by hand" not in new and "| `zero_optimization.sub_group_size` | `500000000.0` |" in new
    assert new.split(memory_begin)[0] == text.split(memory_begin)[0]  # outside the blocks: untouched
    knobs_end = readmes.end("deepspeed-knobs")
    assert new.split(knobs_end, 1)[1] == text.split(knobs_end, 1)[1]
    assert readmes.update(repo_copy, check=True) == []


def test_a_malformed_or_unknown_marker_is_an_error(repo_copy):
    readme = repo_copy / "recipes/llama3-8b-zero3/README.md"
    original = readme.read_text()
    readme.write_text(original + "\n<!-- generated:badges:begin (make readmes; edit x.json, not this block) -->\n")
    with pytest.raises(UserInputError, match="unknown generated block 'badges'"):
        readmes.update(repo_copy, check=True)
    readme.write_text(original.replace("(make readmes; edit memory_plan.json", "(edit memory_plan.json"))
    with pytest.raises(UserInputError, match="begin marker is malformed"):
        readmes.update(repo_copy, check=True)


def test_find_root_from_a_subfolder_and_from_outside(tmp_path, monkeypatch):
    assert find_root(REPO / "recipes/llama3-8b-zero3/configs") == REPO
    monkeypatch.chdir(REPO / "shared/finetune_kit")
    assert find_root() == REPO
    with pytest.raises(UserInputError, match=rf"{tmp_path} is not inside the recipes repository.*pass --root"):
        find_root(tmp_path)


def test_command_line_from_a_recipe_folder():
    proc = subprocess.run([sys.executable, "-m", "finetune_tools.repo", "readmes", "--check"],
                          cwd=REPO / "recipes/llama3-8b-zero3", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generated blocks are current" in proc.stdout


def test_command_line_outside_the_repository_says_how_to_fix_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "finetune_tools.repo", "readmes", "--check"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and "--root" in proc.stderr
