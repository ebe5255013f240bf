"""docker/with-retries.sh: a pip command whose download was cut off midway runs again; any other failure does not."""

from __future__ import annotations

import subprocess

from tests.harness import REPO

# The end of the traceback pip printed when a registry's TLS stream stopped inside a wheel (a CI run's wheelhouse)
CUT_OFF = '''  File "/usr/lib/python3.11/ssl.py", line 1315, in recv_into
    return self.read(nbytes, buffer)
pip._vendor.urllib3.exceptions.ProtocolError: ("Connection broken: ...", ...)'''


def run(failures: int, message: str, tries: int = 3) -> tuple[subprocess.CompletedProcess, int]:
    """with_retries over a command that fails `failures` times printing `message` to standard error, then
    prints 'fetched'; returns the script's result and how many times the command ran."""
    script = f"""set -euo pipefail
source {REPO / "docker/with-retries.sh"}
WITH_RETRIES_PAUSE_S=0 WITH_RETRIES_TRIES={tries}
runs=0
fetch() {{ runs=$(( $(cat "$count") + 1 )); echo "$runs" > "$count"
  if (( runs <= {failures} )); then printf '%s\\n' "$1" >&2; return 2; fi; echo fetched; }}
count="$(mktemp)"; echo 0 > "$count"
with_retries fetch "$MESSAGE" || {{ status=$?; echo "runs $(cat "$count")"; exit "$status"; }}
echo "runs $(cat "$count")"
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"MESSAGE": message,
                                                                                       "PATH": "/usr/bin:/bin"})
    return done, int(done.stdout.split()[-1])


def test_a_download_cut_off_midway_is_fetched_again_and_the_build_goes_on():
    done, runs = run(failures=1, message=CUT_OFF)
    assert (done.returncode, runs) == (0, 2)
    assert done.stdout.startswith("fetched")
    assert "a download was cut off midway (above, exit status 2); trying again in 0 s (try 2 of 3)" in done.stderr


def test_a_download_cut_off_every_time_fails_with_pips_status_after_the_last_try():
    done, runs = run(failures=5, message=CUT_OFF)
    assert (done.returncode, runs) == (2, 3)
    assert done.stderr.count("trying again") == 2  # after the first and the second try, not after the last


def test_any_other_failure_ends_at_once_with_its_own_message():
    # the negative control: an unknown pin fails the same way each time, so it is not run again
    done, runs = run(failures=1, message="ERROR: No matching distribution found for torch==9.9.9")
    assert (done.returncode, runs) == (2, 1)
    assert "trying again" not in done.stderr
    assert "No matching distribution found for torch==9.9.9" in done.stderr
