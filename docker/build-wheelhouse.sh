#!/usr/bin/env bash
# A folder of wheels for the whole pinned stack, for hosts without access to a package index.
#   bash docker/build-wheelhouse.sh [--no-torch] [--dev] [DIR]       (make wheelhouse; DIR: wheelhouse/)
#   bash docker/build-wheelhouse.sh --lock FILE [DIR]                 (for an image build: WHEELHOUSE=DIR)
#     --no-torch   leave torch and its CUDA libraries out (the host's image brings a CUDA build of torch;
#                  install with install-python-deps.sh --keep-torch)
#     --dev        add the test and lint tools (requirements-dev.txt)
#     --lock FILE  exactly the files of a hash lock (docker/requirements.lock or requirements-cpu.lock),
#                  each checked against its hash, DeepSpeed as its sdist: what `--lock FILE` installs
# Run it on a machine with the index and the same Python and platform as the target (the wheels are
# for this interpreter); DeepSpeed is built into a wheel here, against the pinned torch installed here.
# Then, on the target:  bash docker/install-python-deps.sh --wheelhouse DIR [--keep-torch]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/with-retries.sh"  # with_retries: a download cut off midway is fetched again
no_torch=0 dev=0 out="wheelhouse" lock=""
while (($#)); do
  arg="$1"
  case "$arg" in
    --no-torch) no_torch=1 ;;
    --dev) dev=1 ;;
    --lock) lock="${2:?--lock needs a lock file}"; shift ;;
    -*) echo "build-wheelhouse.sh: unknown option '$arg' (use --no-torch, --dev, --lock FILE)" >&2; exit 2 ;;
    *) out="$arg" ;;
  esac
  shift
done
mkdir -p "$out"
if [[ -n "$lock" ]]; then
  with_retries python -m pip download --quiet --require-hashes --no-deps --dest "$out" -r "$lock"
  echo "wheelhouse: $(find "$out" -type f | wc -l) files of $lock, $(du -sh "$out" | cut -f1) in $out"
  exit 0
fi
# Pins published as source only (lm-eval's rouge-score, sqlitedict, word2number): built into wheels here.
sdist_only='rouge-score|sqlitedict|word2number'
rest="$(mktemp)"
grep -vE "^(torch|deepspeed|$sdist_only)==" "$here/requirements.txt" >"$rest"
download=(with_retries python -m pip download --quiet --dest "$out")
if ((!no_torch)); then
  "${download[@]}" "$(grep -E '^torch==' "$here/requirements.txt")"  # with its CUDA libraries on GPU platforms
fi
"${download[@]}" --no-deps --only-binary=:all: -r "$rest" setuptools wheel
if ((dev)); then
  "${download[@]}" --no-deps --only-binary=:all: -r "$here/requirements-dev.txt"
fi
python -c "import torch" 2>/dev/null || with_retries python -m pip install --quiet "$(grep -E '^torch==' "$here/requirements.txt")"
with_retries python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$out" \
  "$(grep -E '^deepspeed==' "$here/requirements.txt")"
# shellcheck disable=SC2046  # one argument per pin
with_retries python -m pip wheel --quiet --no-deps --wheel-dir "$out" $(grep -E "^($sdist_only)==" "$here/requirements.txt")
echo "wheelhouse: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
