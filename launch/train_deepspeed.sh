#!/usr/bin/env bash
# The deepspeed launcher over a hostfile (passwordless ssh to every host, pdsh):
#   HOSTFILE=hostfile launch/train_deepspeed.sh --config C --target T --data D --targets-per-node 4
# Without ssh on a single machine: NO_SSH=1 launch/train_deepspeed.sh ...
# Paths (this folder, the venv, the model and data) must be the same on every host: the launcher runs
# `cd <this directory>; <this python> -m deepspeed.launcher.launch` there (README, "Several nodes").
set -euo pipefail
# Batch shapes change every step: the caching allocator's fixed-size segments would fragment (docs/MEMORY.md).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
HOSTFILE=${HOSTFILE:-hostfile}
MASTER_PORT=${MASTER_PORT:-29500}
# The launcher only warns on a missing hostfile and reports a bad line late: check it first.
dflash-ds check-hostfile "$HOSTFILE"
if [[ -n "${NO_SSH:-}" ]]; then
    exec deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "${NODE_RANK:-0}" --num_nodes "${NUM_NODES:-1}" \
        --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$MASTER_PORT" \
        --module dflash_ds.train "$@"
fi
# Other hosts get only NCCL*, PYTHON*, MV2*, UCX*, MLFLOW* and the lines of an env file: write one with the
# variables the ranks read (PATH, HF_*, WANDB_*, PYTORCH_CUDA_ALLOC_CONF, GLOO_SOCKET_IFNAME, ...) after the
# lines of the user's own .deepspeed_env, which is never written. A DS_ENV_FILE of the user's is used as is.
if [[ -z "${DS_ENV_FILE:-}" ]]; then
    DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/dflash-deepspeed-env.XXXXXX")  # read on this host only, at launch
    export DS_ENV_FILE
    "$(dirname "$(command -v deepspeed)")/python" -m dflash_ds.distributed.hostfile env-file "$DS_ENV_FILE"
fi
exec deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" --module dflash_ds.train "$@"
