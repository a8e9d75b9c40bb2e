#!/usr/bin/env bash
# Many nodes, torchrun with c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0 launch/train_multinode.sh --config C --target T --data D --targets-per-node 4
# RDZV_HOST must resolve to the same machine on every node (it hosts the rendezvous). A name or an address both
# work; ranks pick the network interface that routes to the master themselves (GLOO_SOCKET_IFNAME, if set, wins).
set -euo pipefail
# Batch shapes change every step: the caching allocator's fixed-size segments would fragment (docs/MEMORY.md).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
: "${NNODES:?set NNODES}" "${RDZV_HOST:?set RDZV_HOST}"
NPROC=${NPROC:-8}
RDZV_PORT=${RDZV_PORT:-29400}
# torchrun itself, but its agents' stores (the rendezvous on RDZV_HOST, the one they share with the ranks) listen
# on the node's own address, not on every interface; the node that owns RDZV_HOST hosts the rendezvous, also when
# it is given as an address (dflash_ds/distributed/torchrun.py).
PYTHON="$(dirname "$(command -v torchrun)")/python"
# A stop that signals the whole job (scancel, SLURM's time-limit --signal): an agent still there AGENT_GRACE_S
# (default 5) after its ranks have gone is killed. It may be stuck on the rendezvous store of a node already gone
# (dflash_ds/distributed/agent_watch.py); its ranks' exit records say how the run ended.
# A cut link strands an agent likewise, unsignalled: its ranks, cut off from the store's host, tell the watcher.
"$PYTHON" -m dflash_ds.distributed.agent_watch $$ &
export DFLASH_AGENT_WATCH_PID=$!
exec "$PYTHON" -m dflash_ds.distributed.torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv_id "${RDZV_ID:-dflash}" \
    ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} ${SHUTDOWN_TIMEOUT:+--shutdown-timeout "$SHUTDOWN_TIMEOUT"} \
    -m dflash_ds.train "$@"
