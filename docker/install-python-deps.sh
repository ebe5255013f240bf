#!/usr/bin/env bash
# Install the pinned stack (docker/requirements.txt) into the Python on PATH.
#   bash docker/install-python-deps.sh [--dev] [--wheelhouse DIR] [--keep-torch]
#     --dev             also the test and lint tools (requirements-dev.txt)
#     --wheelhouse DIR  install only from DIR (made by docker/build-wheelhouse.sh): no package index
#     --keep-torch      keep the torch already installed (an NGC image's or a cluster's CUDA build)
# DeepSpeed ships as an sdist whose build imports torch: torch goes in first, then DeepSpeed
# builds against it without build isolation (isolation would fetch another, multi-GB torch).
# A wheelhouse holds DeepSpeed already built as a wheel.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dev=0 keep_torch=0 wheelhouse=""
while (($#)); do
  case "$1" in
    --dev) dev=1 ;;
    --keep-torch) keep_torch=1 ;;
    --wheelhouse) wheelhouse="${2:?--wheelhouse needs a folder}"; shift ;;
    *) echo "install-python-deps.sh: unknown option '$1' (use --dev, --wheelhouse DIR, --keep-torch)" >&2; exit 2 ;;
  esac
  shift
done
pip=(python -m pip install --quiet)
if [[ -n "$wheelhouse" ]]; then
  [[ -d "$wheelhouse" ]] || { echo "install-python-deps.sh: wheelhouse '$wheelhouse' is not a folder" >&2; exit 2; }
  pip+=(--no-index --find-links "$wheelhouse")
fi
requirements="$here/requirements.txt"
if ((keep_torch)); then
  python -c "import torch; print(f'keeping torch {torch.__version__} (CUDA {torch.version.cuda})')"
  requirements="$(mktemp)"
  grep -vE '^torch==' "$here/requirements.txt" >"$requirements"
  "${pip[@]}" setuptools wheel
else
  "${pip[@]}" "$(grep -E '^torch==' "$here/requirements.txt")" setuptools wheel
fi
"${pip[@]}" --no-build-isolation -r "$requirements"
if ((dev)); then
  "${pip[@]}" -r "$here/requirements-dev.txt"
fi
