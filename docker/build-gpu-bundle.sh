#!/usr/bin/env bash
# The wheels a GPU host with its own CUDA PyTorch lacks, for hosts without a package index.
#   bash docker/build-gpu-bundle.sh [--have FREEZE | --host-python PY] [--cuda 130] [--python 3.12]
#        [--extra eval] [--also liger-kernel==0.8.5] [DIR]
#   (make gpu-bundle HAVE=host-packages.txt; DIR: gpu-bundle/)
# FREEZE is the host's `python3 -m pip list --format=freeze`; without one, docker/gpu-host-packages.txt
# (the image of the H100/H200 hosts results/ was measured on). `python -m finetune_tools.gpu_check.bundle`
# picks the pinned packages (docker/requirements.txt) the host lacks or has too old for the recipes,
# walking their requirements; it needs the pinned stack installed (make gpu-bundle runs it in nox's).
# DeepSpeed comes as a pure-Python wheel built from its sdist (DS_BUILD_OPS=0: its ops compile on the
# host at first use; `python -m finetune_tools.gpu_check` starts that compile beside the model builds),
# bitsandbytes with only its CPU library and the one for the host's CUDA (--cuda 130 for CUDA 13.0).
# --extra eval adds lm-eval and what it needs (make eval; its source-only pins built into wheels here);
# --also NAME==VERSION a package docker/requirements.txt does not pin (liger-kernel: the GPU images pin it in
#                      requirements-cuda.txt), its requirements not walked.
# About 39 MB for the default host with --extra eval and liger-kernel (23 MB without them). On the host, from the repository root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/shared:$PWD/shared/tools PATH=/tmp/site/bin:$PATH
#   python3 -m finetune_tools.gpu_check --no-save --case-timeout 300
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/with-retries.sh"  # with_retries: a download cut off midway is fetched again
cuda=130 python="" out=gpu-bundle host=(--have "$here/gpu-host-packages.txt") more=()
while (($#)); do
  case "$1" in
    --cuda) cuda="${2:?--cuda needs a release like 130}"; shift ;;
    --python) python="${2:?--python needs a version like 3.12}"; shift ;;
    --have) host=(--have "${2:?--have needs a file of name==version lines}"); shift ;;
    --host-python) host=(--host-python "${2:?--host-python needs the host Python}"); shift ;;
    --extra|--also) more+=("$1" "${2:?$1 needs a value}"); shift ;;
    -*) echo "build-gpu-bundle.sh: unknown option '$1' (use --have FILE, --host-python PY, --cuda N, --python X.Y," \
          "--extra GROUP, --also NAME==VERSION)" >&2
        exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
mkdir -p "$out"
mapfile -t pkgs < <(PYTHONPATH="$here/../shared:$here/../shared/tools${PYTHONPATH:+:$PYTHONPATH}" python -m finetune_tools.gpu_check.bundle \
                      "${host[@]}" ${python:+--python "$python"} "${more[@]}" 2> "$out/why.txt") \
  || { cat "$out/why.txt" >&2; exit 2; }
cat "$out/why.txt" >&2
python="${python:-$(sed -n 's/.* for Python \([0-9]*\.[0-9]*\).*/\1/p' "$out/why.txt")}"
# pins published as source only (lm-eval's): pure Python, built into wheels here
sdist_only='rouge-score|sqlitedict|word2number'
wheels=() deepspeed="" sources=()
for pkg in "${pkgs[@]}"; do
  case "$pkg" in
    deepspeed==*) deepspeed="$pkg" ;;
    *) if [[ "$pkg" =~ ^($sdist_only)== ]]; then sources+=("$pkg"); else wheels+=("$pkg"); fi ;;
  esac
done
platforms=()
for n in 17 24 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
if ((${#wheels[@]})); then
  with_retries python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    --platform manylinux2014_x86_64 "${platforms[@]}" --dest "$out" "${wheels[@]}"
fi
if ((${#sources[@]})); then
  with_retries python -m pip wheel --quiet --no-deps --wheel-dir "$out" "${sources[@]}"
fi
# bitsandbytes ships a library per CUDA/ROCm/XPU release (43 MB): keep the CPU one and the host's
bnb="$(ls "$out"/bitsandbytes-*.whl 2>/dev/null || true)"
tmp="$(mktemp -d)"
[ -z "$bnb" ] || (cd "$tmp" && python -m zipfile -e "$bnb" . \
  && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name "*_cuda${cuda}.so" -delete \
  && test -f "bitsandbytes/libbitsandbytes_cuda${cuda}.so" \
  && grep -vE "libbitsandbytes_" bitsandbytes-*.dist-info/RECORD > RECORD.kept \
  && grep -E "libbitsandbytes_(cpu|cuda${cuda})\.so," bitsandbytes-*.dist-info/RECORD >> RECORD.kept \
  && mv RECORD.kept bitsandbytes-*.dist-info/RECORD && rm "$bnb" && python -m zipfile -c "$bnb" ./*)
rm -rf "$tmp"
# DeepSpeed as a pure-Python wheel: its sdist, no ops built (they need the host's CUDA)
if [ -n "$deepspeed" ]; then
  sdist="$(mktemp -d)"
  with_retries python -m pip download --quiet --no-deps --no-binary=:all: --dest "$sdist" "$deepspeed"
  DS_BUILD_OPS=0 python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$out" "$sdist"/deepspeed-*.tar.gz
  rm -rf "$sdist"
fi
echo "gpu bundle: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -ch "$out"/*.whl | tail -1 | cut -f1) in $out" \
  "(bitsandbytes: cpu, cuda${cuda}; why each: $out/why.txt)"
