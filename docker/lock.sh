#!/usr/bin/env bash
# Regenerate the hash locks from the pins in docker/requirements.txt (make lock):
#   docker/requirements.lock      the GPU images: torch's CUDA build from PyPI with its nvidia-* libraries, and
#                                 the CUDA-only pins of docker/requirements-cuda.txt
#   docker/requirements-cpu.lock  CPU hosts and the CI test image: torch's CPU build
# Each lists exactly the pinned versions plus what torch pulls in, with the sha256 of every file PyPI
# (or the CPU wheel source) has for that version, for `pip install --require-hashes`.
#   bash docker/lock.sh                        needs uv (pinned in requirements-dev.txt) and the index
#   TORCH_CPU_WHEELS=DIR bash docker/lock.sh   CPU torch wheels from a folder instead of PyTorch's index
# The pins stay the one place to change a version; `python -m finetune_tools.repo pins` (run by the unit
# tests) fails when a lock, a Dockerfile or noxfile.py disagrees with them.
set -euo pipefail
cd "$(dirname "$0")/.."
index="${PIP_INDEX:-https://pypi.org/simple}"
cpu_wheels="${TORCH_CPU_WHEELS:-https://download.pytorch.org/whl/cpu/torch/}"
compile=(uv pip compile docker/requirements.txt --generate-hashes --quiet --custom-compile-command "make lock"
         --python-version 3.11 --python-platform x86_64-manylinux_2_28 --index-url "$index")
# --no-config and an empty find-links: nothing from this machine's pip or uv settings leaks in.
export UV_NO_CONFIG=1 PIP_FIND_LINKS=""
"${compile[@]}" docker/requirements-cuda.txt -o docker/requirements.lock
"${compile[@]}" --find-links "$cpu_wheels" -o docker/requirements-cpu.lock
for lock in docker/requirements.lock docker/requirements-cpu.lock; do
  echo "$lock: $(grep -cE '^[A-Za-z0-9]' "$lock") packages, $(grep -c -- '--hash=sha256:' "$lock") hashes"
done
