#!/usr/bin/env bash
# Install the pinned stack (docker/requirements.txt) into the Python on PATH.
#   bash docker/install-python-deps.sh [--dev] [--wheelhouse DIR] [--keep-torch] [--lock FILE]
#     --dev             also the test and lint tools (requirements-dev.txt)
#     --wheelhouse DIR  install only from DIR (made by docker/build-wheelhouse.sh): no package index
#     --keep-torch      keep the torch already installed (an NGC image's or a cluster's CUDA build)
#     --lock FILE       install FILE (docker/requirements.lock or requirements-cpu.lock) with
#                       --require-hashes: every file must match a hash in the lock; DeepSpeed is built
#                       from its sdist, with the ops that DS_BUILD_* in the environment ask for
# DeepSpeed ships as an sdist whose build imports torch: torch goes in first, then DeepSpeed
# builds against it without build isolation (isolation would fetch another, multi-GB torch).
# A wheelhouse holds DeepSpeed already built as a wheel.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/with-retries.sh"  # with_retries: a download cut off midway is fetched again
dev=0 keep_torch=0 wheelhouse="" lock=""
while (($#)); do
  case "$1" in
    --dev) dev=1 ;;
    --keep-torch) keep_torch=1 ;;
    --wheelhouse) wheelhouse="${2:?--wheelhouse needs a folder}"; shift ;;
    --lock) lock="${2:?--lock needs a lock file}"; shift ;;
    *) echo "install-python-deps.sh: unknown option '$1' (use --dev, --wheelhouse DIR, --keep-torch, --lock FILE)" >&2
       exit 2 ;;
  esac
  shift
done
pip=(with_retries python -m pip install --quiet)
if [[ -n "$wheelhouse" ]]; then
  [[ -d "$wheelhouse" ]] || { echo "install-python-deps.sh: wheelhouse '$wheelhouse' is not a folder" >&2; exit 2; }
  pip+=(--no-index --find-links "$wheelhouse")
fi
if [[ -n "$lock" ]]; then
  [[ -f "$lock" ]] || { echo "install-python-deps.sh: lock '$lock' is not a file (make lock writes it)" >&2; exit 2; }
  # The lock is the whole resolved set, so --no-deps; DeepSpeed second, from its sdist (the file the
  # lock hashes), built against the torch just installed.
  rest="$(mktemp)" deepspeed="$(mktemp)"
  awk '/^deepspeed==/ {skip = 1; next} skip && /^[ #]/ {next} {skip = 0; print}' "$lock" >"$rest"
  awk '/^deepspeed==/ {keep = 1; print; next} keep && /^ +--hash/ {print; next} {keep = 0}' "$lock" >"$deepspeed"
  "${pip[@]}" --require-hashes --no-deps -r "$rest"
  # DeepSpeed's ops are one extension each: build them side by side (setuptools' build_ext --parallel,
  # through the extra config file setuptools reads; a quarter less time on 2 cores).
  if [[ -z "${DIST_EXTRA_CONFIG:-}" ]]; then
    DIST_EXTRA_CONFIG="$(mktemp --suffix .cfg)"
    printf '[build_ext]\nparallel = %s\n' "$(nproc)" >"$DIST_EXTRA_CONFIG"
    export DIST_EXTRA_CONFIG
  fi
  "${pip[@]}" --require-hashes --no-deps --no-build-isolation --use-pep517 --no-binary deepspeed -r "$deepspeed"
  python -m pip check
  exit 0
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
