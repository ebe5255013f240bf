"""What every recipe launch in the tests carries in its environment."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import REPO

PRINT_CACHE = ("import torch._inductor.codecache, tests.harness as h; "
               "print(h.launch_env()['TORCHINDUCTOR_CACHE_DIR'])")


def inductor_cache_under(capability: str) -> str:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'shared'}"}
    return subprocess.run([sys.executable, "-c", PRINT_CACHE], env=env, cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_each_cpu_capability_compiles_into_its_own_inductor_cache():
    """Inductor's graph cache key leaves out ATEN_CPU_CAPABILITY: a cache shared between
    capabilities corrupts the heap of a compiled run (harness.inductor_cache). Launches get a
    folder per capability, even after Inductor's import has written its default into the environment."""
    avx2, default = inductor_cache_under("avx2"), inductor_cache_under("default")
    assert avx2 != default
    assert avx2 == inductor_cache_under("avx2")  # the same folder again: compiled once, reused
    assert "torchinductor_" not in avx2  # not Inductor's own default, /tmp/torchinductor_$USER


def test_each_accelerate_launch_takes_a_free_port_of_its_own_unless_given_one():
    """make test runs sessions side by side: a launch on accelerate's default 29500 could meet another's."""
    from tests.harness import accelerate_command

    command = accelerate_command("--x", config="c.yaml")
    port = command[command.index("--main_process_port") + 1]
    assert port.isdigit() and port != "29500" and command[-2:] == ["train.py", "--x"]
    given = accelerate_command(config="c.yaml", launcher_args=("--main_process_port", "1234"))
    assert given.count("--main_process_port") == 1 and given[given.index("--main_process_port") + 1] == "1234"
