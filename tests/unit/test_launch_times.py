"""The launch clock behind the suite-time report: it counts the processes that train, times them, and sums the
steps' seconds their metrics files hold."""

from __future__ import annotations

import json
import subprocess
import sys

from tests import launch_times


def test_a_launch_is_a_command_that_trains():
    assert launch_times.is_launch(["accelerate", "launch", "--config_file", "c.yaml", "train.py", "--max-steps", "4"])
    assert launch_times.is_launch(["deepspeed", "--num_gpus", "2", "train.py"])
    assert launch_times.is_launch(["bash", "slurm/train.sbatch"])
    assert launch_times.is_launch(["make", "-C", "/repo", "recipe-8b-zero3"])
    assert not launch_times.is_launch(["make", "-n", "-C", "/repo", "recipe-8b-zero3"])  # prints, runs nothing
    assert not launch_times.is_launch(["python", "-c", "print(1)"])
    assert not launch_times.is_launch("ip netns add probe")


def test_the_clock_counts_and_times_launches_and_nothing_else(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time; time.sleep(0.3)\n")
    clock = launch_times.LaunchClock()
    clock.install()
    try:
        subprocess.run([sys.executable, str(script)], check=True)  # waited through communicate/wait
        proc = subprocess.Popen([sys.executable, str(script)])
        while proc.poll() is None:  # seen ending through poll
            pass
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)  # not a launch
        launch_times.count(2.0)  # a launch of ranks forked warm (tests/warm_launch.py), timed by its caller
    finally:
        clock.uninstall()
    assert (clock.count, clock.warm) == (3, 1)
    assert 2.6 <= clock.seconds < 7, clock.seconds
    subprocess.run([sys.executable, str(script)], check=True)  # uninstalled: not counted
    launch_times.count(2.0)
    assert (clock.count, clock.warm) == (3, 1)


def test_the_steps_seconds_are_summed_over_every_metrics_file(tmp_path):
    for run, times in {"a": [0.5, 0.25], "b/c": [1.0]}.items():
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time_s": t}) + "\n"
                                                              for i, t in enumerate(times)) + "not json\n")
    assert launch_times.step_seconds(tmp_path) == (2, 1.75)
    clock = launch_times.LaunchClock()
    clock.count, clock.warm, clock.seconds = 3, 1, 12.34
    entry = launch_times.record(tmp_path / "root", "test-x", clock, tmp_path)
    assert entry == {"session": "test-x", "launches": 3, "warm": 1, "launch_seconds": 12.3, "metrics_files": 2,
                     "step_seconds": 1.8}
    assert json.loads((tmp_path / "root" / launch_times.RECORD).read_text()) == entry
