"""One run per output folder: a lock that a live run holds and a dead one cannot keep.

Two launches into one folder (a double submit; a requeued job that lands beside one not quite dead:
torchrun starts every worker in a session of its own, so killing a launcher's process group leaves its
ranks training) would otherwise both run: the second's input checks delete the first's checkpoint being
written, both write the same steps, and one of them fails on a file the other renamed.

A launch's checks refuse a folder that a live run holds (:func:`check_free`); the main rank of a run
then holds ``<output>/run.lock`` (JSON: host, process, since when, the command) from just before its
first step to its end (:func:`hold_output`, the ``with`` block every recipe wraps its run in), and rewrites it every
:data:`HEARTBEAT_S` seconds. A launch that finds it:

* held by a process on this machine (same host, boot and process namespace): alive if that process
  still runs, with the same start time; otherwise the lock is left over and taken;
* held from another machine or container: alive if its heartbeat moves within :data:`STALE_S`
  seconds (the launch waits that long at most, and says so); a lost node's lock stops moving.

A live holder stops the launch with one line naming it and the fix, before anything in the folder is
touched. The lock is removed when the run ends, however it ends, except by SIGKILL or a lost node: the
rules above then let the relaunch that resumes the run take it over.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from finetune_kit.errors import ConfigError

LOCK = "run.lock"
HEARTBEAT_S = 10.0  # how often a holder rewrites its lock
STALE_S = 35.0  # a lock from another machine whose heartbeat does not move for this long belongs to a dead run


def _machine() -> dict:
    """What makes a process id meaningful: host, boot, process namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return {"host": socket.gethostname(), "boot_id": boot.read_text().strip() if boot.is_file() else "",
            "pid_namespace": namespace}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class RunLock:
    """This process's hold on ``<output>/run.lock``: :meth:`release` it (or let the process end)."""

    def __init__(self, output: Path):
        self.path = Path(output) / LOCK
        self.token = uuid.uuid4().hex
        self.record = {**_machine(), "pid": os.getpid(), "process_start": _start_time(os.getpid()),
                       "since": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                       "command": " ".join(sys.argv), "token": self.token, "beat": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.created_folder = False

    def _write(self, target: Path) -> None:
        target.write_text(json.dumps(self.record, indent=1) + "\n")

    def take(self) -> bool:
        """Create the lock file if there is none (atomic: a hard link fails if the name exists)."""
        tmp = self.path.with_name(f".{LOCK}.{self.token}")
        self._write(tmp)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.is_mine():
                return
            self.record["beat"] += 1
            tmp = self.path.with_name(f".{LOCK}.{self.token}")
            self._write(tmp)
            os.replace(tmp, self.path)

    def is_mine(self) -> bool:
        held = read(self.path.parent)
        return held is not None and held.get("token") == self.token

    def release(self) -> None:
        """Remove the lock if this process still holds it; idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.is_mine():
            self.path.unlink(missing_ok=True)
            if self.created_folder and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()  # a launch that stopped in its checks leaves no empty folder


_HELD: dict[Path, RunLock] = {}


def read(output: Path) -> dict | None:
    """The lock's record, or None if there is none (or it is being replaced this instant)."""
    try:
        return json.loads((Path(output) / LOCK).read_text())
    except (OSError, ValueError):
        return None


def alive(record: dict, output: Path, wait_s: float | None = None, announce=print) -> bool:
    """Whether the run that wrote ``record`` still runs (see the module's rules). A holder on another
    machine is watched for up to ``wait_s`` (default :data:`STALE_S`) seconds for a heartbeat."""
    here = _machine()
    if all(record.get(k) == here[k] for k in here):
        return record.get("process_start") is not None and _start_time(int(record["pid"])) == record["process_start"]
    wait_s = STALE_S if wait_s is None else wait_s
    announce(f"{Path(output) / LOCK} is held by process {record.get('pid')} on {record.get('host')} (since "
             f"{record.get('since')}); watching its heartbeat for up to {wait_s:.0f} s to tell a live run from "
             "one that died")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, wait_s))
        now = read(output)
        if now is None or now.get("token") != record.get("token"):
            return False  # released, or taken over by another launch (which the caller re-reads)
        if now.get("beat") != record.get("beat"):
            return True
    return False


def held_error(record: dict, output: Path) -> ConfigError:
    return ConfigError(
        f"output folder '{output}' is in use by a running job: process {record.get('pid')} on host "
        f"{record.get('host')}, since {record.get('since')} ({Path(output) / LOCK}). Wait for it to finish, "
        "or stop every process of that job (its ranks too: killing the launcher alone leaves them "
        "running), then relaunch to resume; or choose another output folder. Nothing was changed.")


def check_free(output: Path) -> None:
    """Raise ConfigError if a live run holds ``output``; remove a lock that a dead run left. For a launch's
    checks, before anything in the folder is touched; :func:`acquire` takes the lock when the run starts."""
    output = Path(output)
    record = read(output)
    if record is None or output in _HELD:
        return
    if alive(record, output):
        raise held_error(record, output)
    if read(output) == record:  # still the dead run's
        (output / LOCK).unlink(missing_ok=True)


def acquire(output: Path) -> RunLock:
    """Hold ``output``'s lock for this process until :meth:`RunLock.release` or exit; raise
    ConfigError if a live run holds it. A lock left by a dead run is taken over."""
    output = Path(output)
    if output in _HELD:
        return _HELD[output]
    lock = RunLock(output)
    lock.created_folder = not output.exists()  # removed again, if still empty, on release
    output.mkdir(parents=True, exist_ok=True)
    while not lock.take():
        check_free(output)  # raises for a live holder, removes a dead one's lock; then race for it like anyone
    lock.start_heartbeat()
    _HELD[output] = lock
    return lock


def release(output: Path) -> None:
    """Release this process's hold on ``output``'s lock, if it has one."""
    lock = _HELD.pop(Path(output), None)
    if lock is not None:
        lock.release()


@contextmanager
def hold_output(output: Path, holder: bool = True):
    """``output``'s lock held over the ``with`` block by the run's main rank (``holder``; the other ranks hold
    nothing), and released however the block ends: where a recipe's run takes its folder and gives it back."""
    if not holder:
        yield None
        return
    lock = acquire(output)
    try:
        yield lock
    finally:
        release(output)
