"""A bad flag or flag value is one line that names it (training/arguments.py), as every other bad input is."""

from __future__ import annotations

import pytest

from tests.harness import REPO, load_script


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
