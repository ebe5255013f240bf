#!/usr/bin/env bash
# The wheels a GPU host with its own CUDA PyTorch lacks, for hosts without a package index.
#   bash docker/build-gpu-bundle.sh [--cuda 130] [--python 3.12] [DIR]       (make gpu-bundle; DIR: gpu-bundle/)
# What a typical GPU image (torch, accelerate, numpy, pandas, pyarrow, tokenizers, safetensors, ninja)
# does not bring at the pinned version: transformers, peft, datasets and its pure-Python needs,
# pydantic, hjson, DeepSpeed (built here as a pure-Python wheel, DS_BUILD_OPS=0: its ops compile on
# the host at first use, `python -m finetune_kit.gpu_check` starts that compile beside the model builds),
# bitsandbytes with only its CPU library and the one for the host's CUDA (--cuda 130 for CUDA 13.0).
# About 23 MB. On the host, from the repository root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/shared PATH=/tmp/site/bin:$PATH
#   python3 -m finetune_kit.gpu_check --no-save --case-timeout 300
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cuda=130 python=3.12 out=gpu-bundle
while (($#)); do
  case "$1" in
    --cuda) cuda="${2:?--cuda needs a release like 130}"; shift ;;
    --python) python="${2:?--python needs a version like 3.12}"; shift ;;
    -*) echo "build-gpu-bundle.sh: unknown option '$1' (use --cuda N, --python X.Y)" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
pin() { grep -iE "^$1==" "$here/requirements.txt" || { echo "build-gpu-bundle.sh: $1 is not pinned in requirements.txt" >&2; exit 2; }; }
mkdir -p "$out"
platforms=()
for n in 17 24 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
pkgs=()
for name in transformers peft datasets dill multiprocess pydantic pydantic_core annotated-types typing-inspection \
            typing_extensions hjson bitsandbytes; do pkgs+=("$(pin "$name")"); done
python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
  --platform manylinux2014_x86_64 "${platforms[@]}" --dest "$out" "${pkgs[@]}"
# bitsandbytes ships a library per CUDA/ROCm/XPU release (43 MB): keep the CPU one and the host's
bnb="$(ls "$out"/bitsandbytes-*.whl)"
tmp="$(mktemp -d)"
(cd "$tmp" && python -m zipfile -e "$bnb" . \
  && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name "*_cuda${cuda}.so" -delete \
  && test -f "bitsandbytes/libbitsandbytes_cuda${cuda}.so" \
  && grep -vE "libbitsandbytes_" bitsandbytes-*.dist-info/RECORD > RECORD.kept \
  && grep -E "libbitsandbytes_(cpu|cuda${cuda})\.so," bitsandbytes-*.dist-info/RECORD >> RECORD.kept \
  && mv RECORD.kept bitsandbytes-*.dist-info/RECORD && rm "$bnb" && python -m zipfile -c "$bnb" ./*)
rm -rf "$tmp"
# DeepSpeed as a pure-Python wheel: its sdist, no ops built (they need the host's CUDA)
sdist="$(mktemp -d)"
python -m pip download --quiet --no-deps --no-binary=:all: --dest "$sdist" "$(pin deepspeed)"
DS_BUILD_OPS=0 python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$out" "$sdist"/deepspeed-*.tar.gz
rm -rf "$sdist"
echo "gpu bundle: $(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out (bitsandbytes: cpu, cuda${cuda})"
