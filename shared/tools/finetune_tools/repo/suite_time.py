"""Where `make test`'s time went, against a written budget per session: a report, never a failure.

    python -m finetune_tools.repo suite-time LOG      # .ci/run calls it with make test's output

Reads ``.nox/session-times.jsonl`` (one line per nox session: its name, wall-clock and CPU seconds and result,
written by noxfile.py as each session ends), ``.nox/launches.jsonl`` (per test session: how many training launches
it started, real (every interpreter started afresh) and warm (ranks forked from a process that imported the stack),
their seconds and their steps' seconds, written by tests/launch_times.py) and, from ``LOG``, the
per-test durations pytest printed (``--durations``). Prints each session's minutes beside its budget
(``tests/session-budgets.toml``) with its CPU minutes (of 2 per minute on a 2-core machine), its launches (a change
that adds one shows as a number) and
how much of their time their training steps took (the rest is start-up and saving), which ran side by side,
the sessions' minutes added up (the ops' compile and the image build, in the background, aside), the
wall-clock time from the first session's start to the last one's end against the suite's budget, and the ten
slowest tests; a ``warning:`` line for each session over its budget and for the wall clock over the suite's.
The machines CI runs on are shared and differ in speed: a budget is a line to notice, not a test to fail.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

TIMES = ".nox/session-times.jsonl"
LAUNCHES = ".nox/launches.jsonl"
BUDGETS = "tests/session-budgets.toml"
BESIDE = ("ops", "image-build")  # run in the background, beside the others: not part of the total
SESSION_START = re.compile(r"^nox > Running session (\S+)")
DURATION = re.compile(r"^\s*([0-9.]+)s (call|setup|teardown)\s+(\S+)")


@dataclass(frozen=True)
class Slow:
    seconds: float
    phase: str  # call, setup or teardown
    test: str
    session: str | None


def session_times(path: Path) -> dict[str, dict]:
    """The last line of each session in ``path`` (a session run twice: its last run)."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            out[entry["session"]] = entry
    return out


def launch_times(path: Path) -> dict[str, dict]:
    """Per session, the sum of its pytest processes' launch figures in ``path``."""
    out: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                into = out.setdefault(entry["session"], {"launches": 0, "warm": 0, "launch_seconds": 0.0,
                                                         "step_seconds": 0.0})
                for key in into:
                    into[key] += entry.get(key, 0)
    return out


def slowest(log: str, count: int = 10) -> list[Slow]:
    """The ``count`` longest test phases pytest reported in ``log``, each with the session it ran in."""
    found, session = [], None
    for line in log.splitlines():
        if start := SESSION_START.match(line):
            session = start.group(1)
        elif hit := DURATION.match(line):
            found.append(Slow(float(hit.group(1)), hit.group(2), hit.group(3), session))
    return sorted(found, key=lambda s: -s.seconds)[:count]


def side_by_side(times: dict[str, dict]) -> set[str]:
    """The sessions, background jobs aside, that ran while another of them ran."""
    spans = {name: (e["started"], e["started"] + e["seconds"]) for name, e in times.items()
             if "started" in e and name not in BESIDE}
    overlap = 1.0  # seconds: the times are written rounded, so one session's end may pass the next one's start
    return {name for name, (start, end) in spans.items()
            if any(other != name and start < o_end - overlap and o_start < end - overlap
                   for other, (o_start, o_end) in spans.items())}


def report(times: dict[str, dict], budgets: dict, slow: list[Slow], launches: dict[str, dict] | None = None
           ) -> list[str]:
    """The report's lines: a table of sessions, the total, the slowest tests, then the warnings."""
    minutes, launches = budgets.get("minutes", {}), launches or {}
    lines = [f"suite time, per session (budgets: {BUDGETS}; CPU: minutes of all cores; launches: how many trained, "
             "real (interpreters started afresh) and warm (ranks forked from one that imported the stack), "
             "their minutes, of which their steps):",
             f"  {'session':<28} {'minutes':>8} {'budget':>7} {'CPU':>6} {'real':>5} {'warm':>5} {'minutes':>8} "
             f"{'steps':>6}"]
    warnings = []
    total = 0.0
    sided = side_by_side(times)
    for name, entry in times.items():
        spent = entry["seconds"] / 60
        budget = minutes.get(name)
        beside = " (in the background)" if name in BESIDE else " (side by side)" if name in sided else ""
        if name not in BESIDE:
            total += spent
        state = "" if entry.get("ok", True) else " FAILED"
        cpu = f"{entry['cpu_seconds'] / 60:.1f}" if "cpu_seconds" in entry else "-"
        ran = launches.get(name)
        # an sbatch returns at once, its job runs under slurmd: counted, its minutes not known here
        timed = f"{ran['launch_seconds'] / 60:>8.1f}" if ran and ran["launch_seconds"] else f"{'-':>8}"
        counts = (f"{ran['launches'] - ran['warm']:>5} {ran['warm']:>5} {timed} {ran['step_seconds'] / 60:>6.1f}" if ran
                  else f"{'-':>5} {'-':>5} {'-':>8} {'-':>6}")
        lines.append(f"  {name:<28} {spent:>8.1f} {budget if budget is not None else '-':>7} {cpu:>6} {counts}"
                     f"{beside}{state}")
        if budget is None:
            warnings.append(f"warning: session {name} has no budget in {BUDGETS}")
        elif spent > budget:
            warnings.append(f"warning: session {name} took {spent:.1f} min, over its budget of {budget} min")
    suite = budgets.get("suite_minutes")
    lines.append(f"  {'sessions added up':<28} {total:>8.1f}")
    spans = [(e["started"], e["started"] + e["seconds"]) for e in times.values() if "started" in e]
    wall = (max(end for _, end in spans) - min(start for start, _ in spans)) / 60 if spans else total
    lines.append(f"  {'wall clock, first to last':<28} {wall:>8.1f} {suite if suite is not None else '-':>7}")
    if suite is not None and wall > suite:
        warnings.append(f"warning: make test took {wall:.1f} min, first session to last, over the suite's budget "
                        f"of {suite} min")
    if slow:
        lines += ["the slowest tests:"] + [f"  {s.seconds:>7.1f} s  {s.phase:<8} {s.test}  ({s.session or '?'})"
                                           for s in slow]
    return lines + warnings


def main(log_path: Path, root: Path) -> int:
    budgets = tomllib.loads((root / BUDGETS).read_text()) if (root / BUDGETS).is_file() else {}
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    print("\n".join(report(session_times(root / TIMES), budgets, slowest(log), launch_times(root / LAUNCHES))))
    return 0
