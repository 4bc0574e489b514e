#!/usr/bin/env bash
# Sets up (or refreshes) the kcla_mm development environment in .venv/:
# torch, mmengine, mmcv (built from source with ops, wheel cached), mmdet,
# mmsegmentation, pycocotools and kcla_mm itself (editable, with kcla_mm._ext).
# Safe to re-run; a re-run with a cached mmcv wheel takes seconds.
#
# Environment:
#   PYTHON           interpreter to create the venv with (default: python3, must be 3.11)
#   KCLA_VENV        virtualenv path (default: <repo>/.venv)
#   KCLA_WHEELHOUSE  where the built mmcv wheel is cached
#                    (default: ~/.cache/kcla_mm/wheelhouse)
#   KCLA_WITH_OPS=0  skip building kcla_mm._ext (the PyTorch path is used)
#   MAX_JOBS         parallel compile jobs for mmcv and kcla_mm._ext
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KCLA_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
WHEELHOUSE="${KCLA_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kcla_mm/wheelhouse}"
MMCV_VERSION=2.1.0
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

log() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
        || { echo "[setup] error: $PYTHON is not Python 3.11 (set PYTHON=...)" >&2; exit 1; }
    log "creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check --quiet)
# pip >= 24 builds editable installs through PEP 660 (the venv's bundled pip
# falls back to `setup.py develop`, which ignores --no-build-isolation)
"${PIP[@]}" 'pip>=24'

if ! "$PY" -c 'import torch' 2>/dev/null; then
    log "installing torch 2.13.0"
    "${PIP[@]}" torch==2.13.0
fi
if "$PY" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 3))'; then
    log "torch before 2.3: keeping numpy below 2 (requirements/numpy1.txt)"
    PIP+=(-c "$ROOT/requirements/numpy1.txt")
fi
"${PIP[@]}" -r "$ROOT/requirements/build.txt"

if ! "$PY" -c 'import mmcv, mmcv._ext' 2>/dev/null; then
    TAG="$("$PY" -c 'import sys, torch; print(f"torch{torch.__version__}-cp{sys.version_info[0]}{sys.version_info[1]}")')"
    CACHE="$WHEELHOUSE/$TAG"
    WHEEL="$(ls "$CACHE"/mmcv-$MMCV_VERSION-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$WHEEL" ]; then
        log "building mmcv $MMCV_VERSION with ops from source (about 12 minutes on 2 cores)"
        TMP="$(mktemp -d "${WHEELHOUSE}.build.XXXXXX" 2>/dev/null || { mkdir -p "$WHEELHOUSE"; mktemp -d "${WHEELHOUSE}.build.XXXXXX"; })"
        # --no-cache-dir: pip's own wheel cache does not key on torch, and
        # would hand back an mmcv built against another torch
        MMCV_WITH_OPS=1 "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation \
            --no-cache-dir --no-deps "mmcv==$MMCV_VERSION" -w "$TMP"
        mkdir -p "$CACHE"
        mv "$TMP"/mmcv-*.whl "$CACHE"/   # the cache only ever holds complete wheels
        rm -rf "$TMP"
        WHEEL="$(ls "$CACHE"/mmcv-$MMCV_VERSION-*.whl | head -n1)"
    else
        log "using cached mmcv wheel $WHEEL"
    fi
    "${PIP[@]}" "$WHEEL"
fi

log "installing mmengine, mmdet, mmsegmentation and test requirements"
"${PIP[@]}" -r "$ROOT/requirements/mminstall.txt" -r "$ROOT/requirements/runtime.txt" \
    -r "$ROOT/requirements/tests.txt"

log "installing kcla_mm (editable) and building kcla_mm._ext"
# The editable install only registers the source tree (KCLA_WITH_OPS=0: no
# compile); the extension is then built in place, incrementally by ninja.
INSTALLED="$(cd / && "$PY" -c 'import kcla_mm, os; print(os.path.dirname(os.path.dirname(os.path.abspath(kcla_mm.__file__))))' 2>/dev/null || true)"
if [ "$INSTALLED" != "$ROOT" ]; then
    KCLA_WITH_OPS=0 "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
fi
if [ "${KCLA_WITH_OPS:-1}" != "0" ]; then
    ( cd "$ROOT" && "$PY" setup.py --quiet build_ext --inplace )
fi
(cd / && "$PY" -c 'import mmcv.ops, mmdet, mmseg, kcla_mm; print("[setup] ok: mmcv", mmcv.__version__, "mmdet", mmdet.__version__, "mmseg", mmseg.__version__, "kcla_mm", kcla_mm.__version__, "_ext:", kcla_mm.ops.ext_available())')
