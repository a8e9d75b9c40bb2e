#!/usr/bin/env bash
# One node, torchrun: NPROC ranks (one per GPU; CPU processes with gloo when there is no GPU).
#   NPROC=8 launch/train.sh --config configs/tiny.yaml --target T --data D --num-target-ranks 4
set -euo pipefail
# Batch shapes change every step: the caching allocator's fixed-size segments would fragment (docs/MEMORY.md).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
NPROC=${NPROC:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L | wc -l) || echo 3)}
MASTER_PORT=${MASTER_PORT:-29500}
# torchrun, its stores on loopback rather than on every interface (dflash_ds/distributed/torchrun.py).
PYTHON="$(dirname "$(command -v torchrun)")/python"
exec "$PYTHON" -m dflash_ds.distributed.torchrun --standalone --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" \
    -m dflash_ds.train "$@"
