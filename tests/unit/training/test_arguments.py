"""A bad flag or flag value is one line that names it and points at --help (finetune_kit.command_line), in the three
recipes, the package's commands and the tools, as every other bad input is."""

from __future__ import annotations

import pytest

from tests.harness import REPO, load_script


@pytest.mark.parametrize("recipe", ["llama3-8b-zero3", "llama2-13b-zero2", "llama3-70b-qlora"])
def test_each_recipe_says_a_bad_value_in_one_line(recipe, capsys):
    script = load_script(REPO / f"recipes/{recipe}/train.py")
    with pytest.raises(SystemExit) as stopped:
        script.parse_args(["--micro-batch-size" if recipe != "llama2-13b-zero2" else "--per_device_train_batch_size",
                           "two"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "invalid int value: 'two'" in err, err
    assert err.rstrip().endswith("--help for every flag."), err


def entry_points():
    from finetune_kit import check
    from finetune_kit.launch import multinode
    from finetune_kit.training.checkpointing import resharding
    from finetune_tools import merge, tiny_models
    from finetune_tools.gpu_check import bundle, runner, smoke
    from finetune_tools.harness import __main__ as harness
    from finetune_tools.planning import cli
    from finetune_tools.repo import __main__ as repo
    from finetune_tools.results import report

    return {"python -m finetune_kit.check": check.main, "python -m finetune_tools.merge": merge.main,
            "python -m finetune_tools.harness": lambda argv: harness.parser().parse_args(argv),
            "python -m finetune_kit.launch.multinode": multinode.main,
            "python -m finetune_kit.training.checkpointing.resharding": resharding.main,
            "python -m finetune_tools.tiny_models": tiny_models.main, "python -m finetune_tools.gpu_check.bundle":
            bundle.main, "python -m finetune_tools.gpu_check": runner.parse_args,
            "python -m finetune_tools.gpu_check --smoke": smoke.parse_args,
            "python -m finetune_tools.planning": cli.parse_args, "python -m finetune_tools.repo": repo.main,
            "python -m finetune_tools.results": report.main}


def test_every_command_says_a_bad_flag_in_one_line_naming_itself(capsys):
    """(A command with required arguments names those first, as argparse checks them before unknown flags.)"""
    for prog, entry in entry_points().items():
        with pytest.raises(SystemExit) as stopped:
            entry(["--no-such-flag"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1, (prog, err)
        assert err.startswith(f"{prog}: error: ") and err.endswith(f". Run {prog} --help for every flag.\n"), err
        assert "--no-such-flag" in err or "required" in err, err


def test_no_parser_is_built_without_one_line_errors():
    """Every parser in the package and the tools is command_line's (the recipes' go through arguments.parse)."""
    found = [str(p.relative_to(REPO)) for p in (REPO / "shared").rglob("*.py")
             if "build" not in p.parts and "argparse.ArgumentParser(" in p.read_text()
             and p.name != "command_line.py"]
    assert found == []


@pytest.mark.parametrize("argv, says", [
    (["--fp8", "e4m3"], "argument --fp8: invalid choice: 'e4m3'"),
    (["--max-seq-len", "long"], "--max-seq-len: invalid int value: 'long'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_one_line_naming_it_and_help(argv, says, capsys):
    recipe = load_script(REPO / "recipes/llama3-8b-zero3/train.py")
    with pytest.raises(SystemExit) as stopped:
        recipe.parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.count("\n") == 1 and says in err and "--help" in err, err  # argparse alone prints its usage first


def test_help_still_prints_the_usage(capsys):
    recipe = load_script(REPO / "recipes/llama3-8b-zero3/train.py")
    with pytest.raises(SystemExit):
        recipe.parse_args(["--help"])
    assert "--fp8" in capsys.readouterr().out
