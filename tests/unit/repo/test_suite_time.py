"""The suite-time report .ci/run ends with: each session's minutes against its budget, the slowest tests, and a
warning for what is over; never a failure."""

from __future__ import annotations

import json

import tomllib

from finetune_tools.repo import suite_time
from tests.harness import REPO

LOG = """\
nox > Running session unit
============================= slowest durations ==============================
62.49s call     tests/unit/training/test_adam_resume.py::test_a_resumed_native_adam[cpu_adam]
0.51s setup    tests/unit/test_x.py::test_y
nox > Running session test-llama3-8b-zero3
127.27s call     tests/recipes/test_llama3_8b_zero3.py::test_levers[compiled-layers-fsdp2]
86.49s setup    tests/recipes/test_llama3_8b_zero3.py::test_the_run_leaves_no_buffer_in_dev_shm
"""


def write_times(root, sessions: dict[str, float], failed=()) -> None:
    (root / ".nox").mkdir(parents=True)
    (root / suite_time.TIMES).write_text("".join(json.dumps({"session": s, "seconds": t, "ok": s not in failed}) + "\n"
                                                 for s, t in sessions.items()))


def test_the_slowest_tests_are_named_with_their_session():
    slow = suite_time.slowest(LOG, count=3)
    assert [(s.seconds, s.phase, s.session) for s in slow] == [(127.27, "call", "test-llama3-8b-zero3"),
                                                               (86.49, "setup", "test-llama3-8b-zero3"),
                                                               (62.49, "call", "unit")]


def test_a_session_over_its_budget_is_a_warning_and_one_within_is_not(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / suite_time.BUDGETS).write_text("suite_minutes = 10\n[minutes]\nunit = 5\ntest-llama3-8b-zero3 = 4\n"
                                               "image-build = 12\n")
    write_times(tmp_path, {"unit": 240.0, "test-llama3-8b-zero3": 330.0, "image-build": 600.0}, failed=("unit",))
    log = tmp_path / "log"
    log.write_text(LOG)
    assert suite_time.main(log, tmp_path) == 0  # a report, whatever it finds
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if line.startswith("warning:")]
    assert warnings == ["warning: session test-llama3-8b-zero3 took 5.5 min, over its budget of 4 min"]
    assert any(line.split()[:2] == ["unit", "4.0"] and line.endswith("FAILED") for line in out)
    assert any("image-build" in line and "(in the background)" in line for line in out)
    assert next(line for line in out if "sessions added up" in line).split()[-1] == "9.5"  # the build aside
    assert next(line for line in out if "wall clock" in line).split()[-2:] == ["9.5", "10"]  # no start times
    write_times(tmp_path / "over", {"unit": 700.0})
    (tmp_path / "over/tests").mkdir()
    (tmp_path / "over" / suite_time.BUDGETS).write_text((tmp_path / suite_time.BUDGETS).read_text())
    suite_time.main(log, tmp_path / "over")
    over = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert over == ["warning: session unit took 11.7 min, over its budget of 5 min",
                    "warning: make test took 11.7 min, first session to last, over the suite's budget of 10 min"]


def lanes_of_make_test() -> tuple[list[str], list[str], list[str]]:
    """make test's sessions, its main lane and its side lane (Makefile)."""
    import re

    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return tuple(re.search(rf"^{name} := (.*)$", makefile, re.M).group(1).split()
                 for name in ("TEST_SESSIONS", "MAIN_SESSIONS", "SIDE_SESSIONS"))


def longest_path(minutes: dict[str, float]) -> float:
    """make test's minutes by its budgets, as its Makefile runs the sessions: the stack (lint beside it), the unit
    tests, the longer of the two lanes, the rest one after another, then the image session once the images the
    background built are there."""
    sessions, main, side = lanes_of_make_test()
    rest = [s for s in sessions if s not in {"lint", "stack", "unit", "image", *main, *side}]
    lanes = max(sum(minutes[s] for s in main), sum(minutes[s] for s in side))
    before_images = max(minutes["stack"], minutes["lint"]) + minutes["unit"] + lanes + sum(minutes[s] for s in rest)
    return max(before_images, minutes["image-build"]) + minutes["image"]


def test_every_make_test_session_has_a_budget_and_the_suites_holds_its_longest_path():
    """The sessions of a lane run beside the other lane's, so the budgets add up to more than the wall clock: the
    suite's budget holds the longest path through the Makefile's order, taken at the sessions' budgets."""
    budgets = tomllib.loads((REPO / suite_time.BUDGETS).read_text())
    sessions, _, _ = lanes_of_make_test()
    assert set(budgets["minutes"]) == set(sessions) | set(suite_time.BESIDE)
    assert longest_path(budgets["minutes"]) <= budgets["suite_minutes"]
    # the negative control: the last session a minute past the suite's slack is over the suite's budget
    over = dict(budgets["minutes"])
    over["image"] += budgets["suite_minutes"] - longest_path(budgets["minutes"]) + 1
    assert longest_path(over) > budgets["suite_minutes"]


def test_the_wall_clock_runs_from_the_first_sessions_start_to_the_last_ones_end(tmp_path, capsys):
    (tmp_path / ".nox").mkdir()
    entries = [{"session": "lint", "started": 1000.0, "seconds": 30.0, "ok": True},
               {"session": "ops", "started": 1100.0, "seconds": 900.0, "ok": True},  # in the background
               {"session": "unit", "started": 1100.0, "seconds": 300.0, "ok": True},
               {"session": "test-llama3-8b-zero3", "started": 1400.0, "seconds": 660.0, "ok": True}]
    (tmp_path / suite_time.TIMES).write_text("".join(json.dumps(e) + "\n" for e in entries))
    suite_time.main(tmp_path / "no-log", tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if "wall clock" in line).split()[-2] == "17.7"  # 1000 s to 2060 s
    assert next(line for line in out if "sessions added up" in line).split()[-1] == "16.5"
    assert any(line.split()[0] == "ops" and "(in the background)" in line for line in out)
    assert not any("(side by side)" in line for line in out)  # one after another, the background aside


def test_sessions_that_ran_beside_each_other_are_marked_and_the_wall_clock_is_held_to_the_budget(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / suite_time.BUDGETS).write_text("suite_minutes = 15\n[minutes]\n")
    (tmp_path / ".nox").mkdir()
    entries = [{"session": "unit", "started": 1000.0, "seconds": 300.0, "ok": True},
               {"session": "test-llama3-8b-zero3", "started": 1300.0, "seconds": 600.0, "ok": True},
               {"session": "test-llama2-13b-zero2", "started": 1300.0, "seconds": 400.0, "ok": True},
               {"session": "slurm", "started": 1899.95, "seconds": 100.05, "ok": True}]  # rounded: the 8B's end
    (tmp_path / suite_time.TIMES).write_text("".join(json.dumps(e) + "\n" for e in entries))
    suite_time.main(tmp_path / "no-log", tmp_path)
    out = capsys.readouterr().out.splitlines()
    sided = {line.split()[0] for line in out if line.endswith("(side by side)")}
    assert sided == {"test-llama3-8b-zero3", "test-llama2-13b-zero2"}
    assert next(line for line in out if "sessions added up" in line).split()[-1] == "23.3"
    assert next(line for line in out if "wall clock" in line).split()[-2:] == ["16.7", "15"]  # 1000 s to 2000 s
    assert "warning: make test took 16.7 min, first session to last, over the suite's budget of 15 min" in out


def test_each_session_shows_its_cpu_minutes_launches_and_their_steps(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / suite_time.BUDGETS).write_text("suite_minutes = 10\n[minutes]\nunit = 5\ntest-llama3-8b-zero3 = 4\n")
    (tmp_path / ".nox").mkdir()
    (tmp_path / suite_time.TIMES).write_text(
        json.dumps({"session": "unit", "seconds": 120.0, "cpu_seconds": 180.0, "ok": True}) + "\n"
        + json.dumps({"session": "test-llama3-8b-zero3", "seconds": 600.0, "cpu_seconds": 960.0, "ok": True}) + "\n"
        + json.dumps({"session": "slurm", "seconds": 240.0, "cpu_seconds": 15.0, "ok": True}) + "\n")
    (tmp_path / suite_time.LAUNCHES).write_text(  # two pytest processes in one session add up
        json.dumps({"session": "test-llama3-8b-zero3", "launches": 20, "warm": 15, "launch_seconds": 480.0,
                    "step_seconds": 120.0}) + "\n"
        + json.dumps({"session": "test-llama3-8b-zero3", "launches": 4, "warm": 1, "launch_seconds": 60.0,
                      "step_seconds": 30.0}) + "\n"
        + json.dumps({"session": "slurm", "launches": 4, "launch_seconds": 0.0, "step_seconds": 66.0}) + "\n")
    log = tmp_path / "log"
    log.write_text(LOG)
    suite_time.main(log, tmp_path)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert rows["test-llama3-8b-zero3"][:8] == ["test-llama3-8b-zero3", "10.0", "4", "16.0", "8", "16", "9.0", "2.5"]
    assert rows["unit"][:8] == ["unit", "2.0", "5", "3.0", "-", "-", "-", "-"]  # launched nothing it counts
    assert rows["slurm"][:8] == ["slurm", "4.0", "-", "0.2", "4", "0", "-", "1.1"]  # sbatch: timed by their steps
