#!/usr/bin/env bash
# Compiles and links kcla_mm._ext with CUDA (FORCE_CUDA=1) without a GPU, so
# the .cu sources never rot. torch here is CPU-only, so this uses a separate
# virtualenv with torch 2.14.1 (a CUDA 13.0 build) and the machine's nvcc.
# The extension is built out of tree (into $KCLA_CUDA_BUILD_DIR) and never
# replaces the CPU build in kcla_mm/. The CUDA sources then compile once
# more as C++17 against torch 2.11.0's headers (unpacked into the venv),
# as torch before 2.12 builds them.
#
# Environment: KCLA_CUDA_VENV (default <repo>/.venv-cuda),
#   KCLA_CUDA_BUILD_DIR (default <repo>/build/cuda-check),
#   TORCH_CUDA_ARCH_LIST (default "9.0"), CUDA_HOME (default /usr/local/cuda).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KCLA_CUDA_VENV:-$ROOT/.venv-cuda}"
OUT="${KCLA_CUDA_BUILD_DIR:-$ROOT/build/cuda-check}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

command -v "$CUDA_HOME/bin/nvcc" >/dev/null \
    || { echo "[cuda-check] error: no nvcc under CUDA_HOME=$CUDA_HOME" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
if ! "$VENV/bin/python" -c 'import torch; assert torch.version.cuda' 2>/dev/null; then
    echo "[cuda-check] installing torch 2.14.1 (CUDA build) into $VENV"
    "${PIP[@]}" torch==2.14.1
fi
"${PIP[@]}" -r "$ROOT/requirements/build.txt"
# torch's CUDA headers include cuSPARSE/cuBLAS headers that the machine's
# toolkit lacks; the NVIDIA wheels installed with torch carry them
for inc in "$VENV"/lib/python3*/site-packages/nvidia/*/include; do
    CPATH="${CPATH:+$CPATH:}$inc"
done
export CPATH
rm -rf "$OUT"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute, as in the build's ninja file
cd "$ROOT"
FORCE_CUDA=1 "$VENV/bin/python" setup.py --quiet build_ext \
    --build-lib "$OUT/lib" --build-temp "$OUT/tmp"
SO="$(ls "$OUT"/lib/kcla_mm/_ext*.so)"
# the library must define the CUDA launchers of both op groups (grep reads
# all of nm's output: `grep -q` would stop early and fail the pipeline with
# SIGPIPE)
for sym in "kcla_state_forward_cuda(" "kcla_branch_backward_cuda("; do
    if ! nm -C --defined-only "$SO" | grep -F "$sym" >/dev/null; then
        echo "[cuda-check] error: $SO has no CUDA launcher $sym" >&2
        exit 1
    fi
done
# the device code is built for exactly the architectures named in
# TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX" -> sm_80, sm_90)
WANTED="$(echo "$TORCH_CUDA_ARCH_LIST" | tr ' ;' '\n\n' | sed -e 's/+PTX//' -e 's/\.//' \
    | grep -v '^$' | sed 's/^/sm_/' | sort -u | tr '\n' ' ')"
BUILT="$(grep -o 'code=sm_[0-9a-z]*' "$OUT/tmp/build.ninja" | cut -d= -f2 | sort -u | tr '\n' ' ')"
if [ "$WANTED" != "$BUILT" ]; then
    echo "[cuda-check] error: built for [$BUILT], TORCH_CUDA_ARCH_LIST names [$WANTED]" >&2
    exit 1
fi
# a launcher whose definition does not match its registration's type stays
# an undefined symbol of the library (found only at import time otherwise)
UNDEFINED="$(nm -C --undefined-only "$SO" | grep -F "_cuda(" || true)"
if [ -n "$UNDEFINED" ]; then
    echo "[cuda-check] error: $SO leaves CUDA launchers undefined:" >&2
    echo "$UNDEFINED" >&2
    exit 1
fi
# torch before 2.12 (the GPU machines' 2.11 too) compiles extensions as
# C++17, this torch as C++20, and its headers no longer compile as C++17:
# compile the CUDA sources (pytorch/cuda/) again with -std=c++17 against
# torch 2.11.0's headers, from this build's ninja file (the CPU sources:
# tests/test_ops/test_cpp17_sources.py)
HEADERS17="$VENV/torch-2.11.0-headers"
if [ ! -d "$HEADERS17/torch/include" ]; then
    echo "[cuda-check] unpacking torch 2.11.0's headers into $HEADERS17"
    rm -rf "$HEADERS17.tmp"
    "$VENV/bin/python" -m pip download --disable-pip-version-check --quiet \
        --no-deps torch==2.11.0 -d "$HEADERS17.tmp"
    "$VENV/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist()
                           if n.startswith("torch/include/")])' \
        "$HEADERS17".tmp/torch-2.11.0-*.whl "$HEADERS17.tmp"
    rm "$HEADERS17".tmp/torch-2.11.0-*.whl
    mv "$HEADERS17.tmp" "$HEADERS17"
fi
TORCH_INCLUDE="$("$VENV/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
mkdir -p "$OUT/cpp17"
sed -e 's/-std=c++20/-std=c++17/g' \
    -e "s#$TORCH_INCLUDE#$HEADERS17/torch/include#g" \
    -e "s#^build $OUT/tmp/#build $OUT/cpp17/#" \
    "$OUT/tmp/build.ninja" > "$OUT/cpp17/build.ninja"
mapfile -t OBJECTS17 < <(grep -o "^build $OUT/cpp17/kcla_mm/ops/csrc/pytorch/cuda/[^:]*" \
    "$OUT/cpp17/build.ninja" | cut -c7-)
if [ "${#OBJECTS17[@]}" -eq 0 ]; then
    echo "[cuda-check] error: no CUDA sources in $OUT/tmp/build.ninja" >&2
    exit 1
fi
"$VENV/bin/ninja" -C "$OUT/cpp17" "${OBJECTS17[@]}"
echo "[cuda-check] ok: $SO (CUDA sources also compile as C++17)"
