"""One run per output folder (finetune_kit/output_lock.py): a live holder stops a second launch, a dead one never
blocks the relaunch that resumes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from finetune_kit import output_lock
from finetune_kit.errors import ConfigError

HOLD = """
import sys, time
from finetune_kit import output_lock
output_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process of this machine holding tmp_path/out."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_run_on_this_machine_stops_a_second_launch_naming_it(holder, tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        output_lock.acquire(out)
    assert time.monotonic() - start < 1  # a process of this machine: no waiting
    message = str(err.value)
    assert f"process {holder.pid} on host " in message and "since 20" in message and "run.lock" in message
    assert "stop every process of that job" in message and "choose another output folder" in message
    assert json.loads((out / "run.lock").read_text())["pid"] == holder.pid  # untouched


def test_the_lock_of_a_killed_run_is_taken_over_at_once(holder, tmp_path):
    out = tmp_path / "out"
    holder.kill()  # SIGKILL: no chance to release
    holder.wait()
    assert (out / "run.lock").is_file()
    output_lock.acquire(out)
    try:
        assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        output_lock.release(out)
    assert not (out / "run.lock").exists()


def foreign_lock(out, beat: int = 0) -> dict:
    """A lock written by a run on another machine (a node of a multi-node job, a container)."""
    record = {"host": "node7", "boot_id": "another-boot", "pid_namespace": "pid:[1]", "pid": 4242,
              "process_start": "123", "since": "2026-11-25 10:00:00 UTC", "command": "train.py", "token": "t",
              "beat": beat}
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.lock").write_text(json.dumps(record))
    return record


def test_a_lost_nodes_lock_stops_moving_and_is_taken_over(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(output_lock, "STALE_S", 1.5)
    out = tmp_path / "out"
    foreign_lock(out)
    start = time.monotonic()
    output_lock.acquire(out)
    output_lock.release(out)
    assert 1.5 <= time.monotonic() - start < 5
    assert "watching its heartbeat for up to 2 s" in capsys.readouterr().out


def test_a_live_run_on_another_machine_is_told_by_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(output_lock, "STALE_S", 5.0)
    out = tmp_path / "out"
    record, stop = foreign_lock(out), threading.Event()

    def beat():  # what the holder's heartbeat thread does, every second here: a whole new file, replaced at once
        while not stop.wait(1.0):
            record["beat"] += 1
            (out / "run.lock.beat").write_text(json.dumps(record))
            os.replace(out / "run.lock.beat", out / "run.lock")

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=r"in use by a running job: process 4242 on host node7, since 2026"):
            output_lock.acquire(out)
        assert time.monotonic() - start < 3  # refused at the first beat seen, not after the whole window
    finally:
        stop.set()
        thread.join()


def test_the_holder_beats_and_releases_and_leaves_no_folder_it_made(tmp_path, monkeypatch):
    monkeypatch.setattr(output_lock, "HEARTBEAT_S", 0.2)
    out = tmp_path / "new" / "out"
    output_lock.acquire(out)
    first = json.loads((out / "run.lock").read_text())["beat"]
    deadline = time.monotonic() + 20  # a beat every 0.2 s; a loaded 2-core runner may starve the thread a while
    while json.loads((out / "run.lock").read_text())["beat"] == first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads((out / "run.lock").read_text())["beat"] > first
    output_lock.release(out)
    assert not out.exists()  # a launch that stopped in its checks leaves no empty output folder


def test_a_launchs_checks_refuse_a_live_holder_and_clear_a_dead_ones_lock(holder, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"process {holder.pid} on host"):
        output_lock.check_free(out)
    holder.kill()
    holder.wait()
    output_lock.check_free(out)
    assert not (out / "run.lock").exists()
