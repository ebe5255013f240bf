"""`make results` as the README runs it, in a fresh copy of the repository: its own nox session installs
pydantic and matplotlib only (no torch), and the page, plot and calibration it writes are the committed ones."""

from __future__ import annotations

import os
import subprocess

from tests.harness import REPO

GENERATED = ("results/README.md", "results/throughput.png", "shared/finetune_kit/planning/speed-calibration.json")


def test_make_results_works_from_a_fresh_copy(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    copy = tmp_path / "repo"
    for name in filter(None, files):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((REPO / name).read_bytes())
    # PIP_COMPILE=0: nox's and the session's installs skip pip's bytecode compile; one process then imports them
    proc = subprocess.run(["make", "--no-print-directory", "results"], cwd=copy, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PIP_COMPILE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((copy / ".nox/results/lib").glob("python*/site-packages/pydantic"))  # its own environment ...
    assert not list((copy / ".nox/results/lib").glob("python*/site-packages/torch"))  # ... which has no torch
    for name in GENERATED:
        assert (copy / name).read_bytes() == (REPO / name).read_bytes(), name
