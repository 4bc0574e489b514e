#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds kcla_mm._ext with its CUDA kernels
# in place (replacing a CPU-only build in kcla_mm/), runs the tests that have
# CUDA cases, then the benchmark on the GPU. The Python (default python3)
# must hold a CUDA build of torch that sees the GPU, plus kcla_mm's runtime
# needs (mmengine, mmcv or mmcv-lite; mmdet is not needed: the benchmark's
# plain side is ResNetKCLA(layer_attention=None)).
#
# Usage: bash tools/gpu_check.sh [LOG_DIR]   (default work_dirs/gpu_check)
# Writes device.txt, build.log, tests.log and benchmark.log there; exits
# non-zero if the build, a test or the benchmark fails. Environment: PYTHON,
# TORCH_CUDA_ARCH_LIST (default: GPU 0's), BENCHMARK_RUNS (default 15).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_DIR="${1:-$ROOT/work_dirs/gpu_check}"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
        2>/dev/null; then
    echo "[gpu-check] error: $PY has no torch that sees a CUDA GPU (no" \
         "torch, a CPU build, or no device); tools/check_cuda_build.sh" \
         "checks the CUDA build without one" >&2
    exit 2
fi
mkdir -p "$LOG_DIR"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # for the benchmark
"$PY" -c 'import torch as t; print(t.__version__, t.cuda.get_device_name())' \
    | tee "$LOG_DIR/device.txt"
ARCH="$("$PY" -c \
    'import torch as t; print("%d.%d" % t.cuda.get_device_capability())')"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$ARCH}"
# the system compiler: a wrapper CXX that links libstdc++ statically made the
# extension crash in its error messages (docs/gpu.md, "Known pitfalls")
if ! FORCE_CUDA=1 CC=gcc CXX=g++ MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
        "$PY" setup.py build_ext --inplace > "$LOG_DIR/build.log" 2>&1; then
    tail -30 "$LOG_DIR/build.log"
    echo "[gpu-check] error: the CUDA build failed ($LOG_DIR/build.log)" >&2
    exit 1
fi
"$PY" -c 'from kcla_mm.ops import has_device_impl as h; import sys
sys.exit(not (h("cuda") and h("cuda", "branch")))' || {
    echo "[gpu-check] error: the built kcla_mm._ext has no CUDA kernels" >&2
    exit 1
}
"$PY" -m pytest -ra -p no:cacheprovider \
    tests/test_ops/test_kcla_branch_cuda.py tests/test_ops/test_kcla_state.py \
    tests/test_ops/test_kcla_heads.py tests/test_ops/test_kcla_adapter.py \
    tests/test_ops/test_fused_backward.py tests/test_ops/test_ext_loader.py \
    tests/test_ops/test_kcla_branch.py::test_layer_inference_matches_reference \
    tests/test_models/test_resnet_kcla_impls.py 2>&1 | tee "$LOG_DIR/tests.log"
TESTS=${PIPESTATUS[0]}
"$PY" tools/analysis/benchmark_kcla.py --device cuda --baseline resnetkcla \
    --sections abcdf --runs "${BENCHMARK_RUNS:-15}" --warmup 5 2>&1 \
    | tee "$LOG_DIR/benchmark.log"
BENCH=${PIPESTATUS[0]}
# (a) at the sizes GPU users train at: batch 32 in float32 and under AMP,
# and a detector's input (batch 2 at 800x1216) under AMP
for OPTS in "--batch 32" "--batch 32 --amp" \
        "--batch 2 --size 800 1216 --amp"; do
    # shellcheck disable=SC2086  # OPTS holds several options
    "$PY" tools/analysis/benchmark_kcla.py --device cuda \
        --baseline resnetkcla --sections a --runs "${BENCHMARK_RUNS:-15}" \
        --warmup 5 $OPTS 2>&1 | tee -a "$LOG_DIR/benchmark.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || BENCH=1
done
echo "[gpu-check] tests exit $TESTS, benchmark exit $BENCH; logs in $LOG_DIR"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
