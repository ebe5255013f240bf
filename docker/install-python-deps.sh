#!/usr/bin/env bash
# Install the pinned stack (docker/requirements.txt) into the Python on PATH.
#   bash docker/install-python-deps.sh [--dev]
# DeepSpeed ships as an sdist whose build imports torch: torch goes in first, then DeepSpeed
# builds against it without build isolation (isolation would fetch another, multi-GB torch).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
torch_pin="$(grep -E '^torch==' "$here/requirements.txt")"
python -m pip install --quiet "$torch_pin" setuptools wheel
python -m pip install --quiet --no-build-isolation -r "$here/requirements.txt"
if [[ "${1:-}" == "--dev" ]]; then
  python -m pip install --quiet -r "$here/requirements-dev.txt"
fi
