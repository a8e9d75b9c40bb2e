#!/usr/bin/env bash
# One node, torchrun: NPROC ranks (one per GPU; CPU processes with gloo when there is no GPU).
#   NPROC=8 launch/train.sh --config configs/tiny.yaml --target T --data D --num-target-ranks 4
set -euo pipefail
NPROC=${NPROC:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L | wc -l) || echo 3)}
MASTER_PORT=${MASTER_PORT:-29500}
exec torchrun --standalone --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" \
    -m dflash_ds.train "$@"
