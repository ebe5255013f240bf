"""Where a test session's time goes: its launches, their wall-clock seconds and the seconds their training steps
took, appended to ``.nox/launches.jsonl`` when a ``make test`` session ends (``python -m finetune_tools.repo
suite-time`` prints them beside each session's minutes).

A launch is a process the tests start that trains: a command naming a ``train.py`` (accelerate launch, deepspeed,
torchrun), a ``make`` target, or a Slurm batch script; a real one starts its interpreters afresh, a warm one forks
its ranks from a process that imported the stack once (tests/warm_launch.py). Its seconds run from its start to the
moment a test sees it end. The steps' seconds are the sum of ``step_time_s`` over every ``metrics.jsonl`` the
session's runs wrote: what a launch spends beyond them is start-up (interpreter, imports, process group, engine, data,
model) and the end (evaluation, samples, saving).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

RECORD = ".nox/launches.jsonl"
_active: LaunchClock | None = None  # the installed clock, which launches started without Popen add to


def is_launch(args) -> bool:
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not argv:
        return False
    if argv[0] == "make":
        return "-n" not in argv  # make -n only prints the commands
    return any(a.endswith(("train.py", ".sbatch")) for a in argv)


class LaunchClock:
    """Counts the launches this process starts (``subprocess.Popen``) and sums their seconds."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.count, self.seconds = 0, 0.0
        self.warm = 0  # of count: the launches forked warm (:func:`count`)
        self._patched = None

    def install(self) -> None:
        popen, clock = subprocess.Popen, self
        init, wait, poll = popen.__init__, popen.wait, popen.poll

        def timed_init(proc, args, *rest, **kwargs):
            init(proc, args, *rest, **kwargs)
            if is_launch(args):
                clock.count += 1
                clock.started[id(proc)] = time.monotonic()

        def ended(proc) -> None:
            if proc.returncode is not None and id(proc) in clock.started:
                clock.seconds += time.monotonic() - clock.started.pop(id(proc))

        def timed_wait(proc, *a, **k):
            try:
                return wait(proc, *a, **k)
            finally:
                ended(proc)

        def timed_poll(proc):
            code = poll(proc)
            ended(proc)
            return code

        popen.__init__, popen.wait, popen.poll = timed_init, timed_wait, timed_poll
        self._patched = (init, wait, poll)
        global _active
        _active = self

    def add(self, seconds: float) -> None:
        self.count += 1
        self.warm += 1
        self.seconds += seconds

    def uninstall(self) -> None:
        if self._patched:
            subprocess.Popen.__init__, subprocess.Popen.wait, subprocess.Popen.poll = self._patched
            self._patched = None
        global _active
        if _active is self:
            _active = None


def count(seconds: float) -> None:
    """A launch that took ``seconds`` and started no process through Popen (tests/warm_launch.py's ranks)."""
    if _active is not None:
        _active.add(seconds)


def step_seconds(folder: Path) -> tuple[int, float]:
    """How many ``metrics.jsonl`` files lie under ``folder`` and the sum of their steps' ``step_time_s``."""
    files, total = 0, 0.0
    for path in folder.rglob("metrics.jsonl"):
        files += 1
        for line in path.read_text(errors="replace").splitlines():
            try:
                total += float(json.loads(line).get("step_time_s") or 0.0)
            except (ValueError, AttributeError):
                continue
    return files, total


def record(root: Path, session: str, clock: LaunchClock, basetemp: Path) -> dict:
    """Append this pytest process's launch figures for ``session`` to ``root / RECORD``."""
    files, steps = step_seconds(basetemp) if basetemp.is_dir() else (0, 0.0)
    entry = {"session": session, "launches": clock.count, "warm": clock.warm, "launch_seconds": round(clock.seconds, 1),
             "metrics_files": files, "step_seconds": round(steps, 1)}
    path = root / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def session_name() -> str | None:
    """The ``make test`` session this pytest runs in (noxfile.py's ``timed`` names it), or None outside one."""
    return os.environ.get("SUITE_SESSION")
