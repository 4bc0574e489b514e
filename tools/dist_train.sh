#!/usr/bin/env bash
# Distributed training: torchrun + mmengine's `pytorch` launcher, running
# tools/train.py (mmdet's own train.py, or mmseg's for a segmentation config).
#
#   tools/dist_train.sh CONFIG NPROC [train.py options, e.g. --work-dir DIR]
#
# Environment: PYTHON (default: python), NNODES, NODE_RANK, MASTER_ADDR, PORT.
# Without a GPU the processes train on CPU: tools/train.py applies kcla_mm's
# shim that lets mmengine's launcher start with gloo (in those processes
# only); this script adds DDP without device_ids.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 CONFIG NPROC [train.py options]" >&2
  exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
if [ ! -f "$CONFIG" ]; then
  echo "error: config file $CONFIG not found" >&2
  exit 2
fi
PYTHON=${PYTHON:-python}
TRAIN="$(dirname "$0")/train.py"

CPU_OPTIONS=()
if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  CPU_OPTIONS=(--cfg-options model_wrapper_cfg.type=MMDistributedDataParallel
    model_wrapper_cfg.device_ids=None
    model_wrapper_cfg.broadcast_buffers=False
    model_wrapper_cfg.find_unused_parameters=False)
fi

PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="${NNODES:-1}" \
  --node_rank="${NODE_RANK:-0}" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" \
  --master_port="${PORT:-29500}" \
  --nproc_per_node="$NPROC" \
  "$TRAIN" "$CONFIG" --launcher pytorch "${CPU_OPTIONS[@]}" "$@"
