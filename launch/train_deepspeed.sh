#!/usr/bin/env bash
# The deepspeed launcher over a hostfile (passwordless ssh to every host, pdsh):
#   HOSTFILE=hostfile launch/train_deepspeed.sh --config C --target T --data D --targets-per-node 4
# Without ssh on a single machine: NO_SSH=1 launch/train_deepspeed.sh ...
# Paths (this folder, the venv, the model and data) must be the same on every host: the launcher runs
# `cd <this directory>; <this python> -m deepspeed.launcher.launch` there (docs/TRAINING.md, "The launch routes").
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
# lines of the user's own .deepspeed_env (or of the DS_ENV_FILE they set), which is never written. The launcher
# puts every line on pdsh's command line (`ps` on every host) and in its log, so no secret goes there: every
# variable named like one (*TOKEN*, *KEY*, *SECRET*, *PASSWORD*, *CREDENTIAL*, *AUTH*, from this environment or
# the user's file; dflash_ds/distributed/credentials.py) is written to a folder of mode 0700 on the shared
# filesystem (here, or $DFLASH_CREDENTIALS_DIR) and reaches the ranks by path (HF_TOKEN_PATH,
# DFLASH_SECRETS_FILE), and is unset here: the launcher, which forwards MLFLOW_* and the rest by value itself,
# never sees one. Both are removed when the job ends, however it ends (but SIGKILL to this script): so the
# launcher runs as a child, not exec'd, and signals are passed on to it.
# What the launcher and the ranks print passes through a filter that shows secret values as *** (it knows them:
# started before they are unset here), e.g. one a user put on the command line (dflash_ds/redact.py).
PYTHON="$(dirname "$(command -v deepspeed)")/python"
exec > >("$PYTHON" -m dflash_ds.redact) 2> >("$PYTHON" -m dflash_ds.redact >&2)
# pdsh returns once its ssh session to every host has ended, and nothing ended one to a host cut off: the runner
# and this script waited on it for good after every rank had gone. Keep-alives end such a session (ssh, then pdsh
# -S, the runner and this script exit 255) once the host has been silent for 1.25-1.5 x train.heartbeat_timeout_s:
# longer than the ranks wait for a link that pauses, within the 2 heartbeats in which they end. Placed first, they
# win over ~/.ssh/config and the user's own PDSH_SSH_ARGS_APPEND.
KEEPALIVE=$("$PYTHON" -m dflash_ds.distributed.hostfile ssh-args -- "$@")
export PDSH_SSH_ARGS_APPEND="$KEEPALIVE${PDSH_SSH_ARGS_APPEND:+ $PDSH_SSH_ARGS_APPEND}"
CLEANUP=()
cleanup() { if ((${#CLEANUP[@]})); then rm -rf -- "${CLEANUP[@]}"; fi; }
trap cleanup EXIT
USER_ENV=()
if [[ -n "${DS_ENV_FILE:-}" ]]; then USER_ENV=(--user-env-file "$DS_ENV_FILE"); fi
DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/dflash-deepspeed-env.XXXXXX")  # 0600; read on this host only, at launch
CLEANUP+=("$DS_ENV_FILE")
export DS_ENV_FILE
CREDENTIALS=$(mktemp -d "${DFLASH_CREDENTIALS_DIR:-$PWD}/.dflash-credentials.XXXXXX")  # 0700
CLEANUP+=("$CREDENTIALS")
# Where a SIGTERM asks the job to stop (below); DFLASH_* variables reach every host through the env file.
STOP_FILE=$(mktemp -u "${DFLASH_CREDENTIALS_DIR:-$PWD}/.dflash-stop.XXXXXX")
CLEANUP+=("$STOP_FILE")
export DFLASH_STOP_FILE="$STOP_FILE"
# Prints `unset HF_TOKEN ...; export HF_TOKEN_PATH=... DFLASH_SECRETS_FILE=...` (paths, shell-quoted): the
# launcher gets no secret, only where to read them.
SETUP=$("$PYTHON" -m dflash_ds.distributed.hostfile env-file "$DS_ENV_FILE" --credentials-dir "$CREDENTIALS" \
    "${USER_ENV[@]}")
eval "$SETUP"
# A preemption (SIGTERM to this script) must reach the ranks as a stop, not through the deepspeed runner: it
# answers SIGTERM with SIGINT to pdsh, `pkill -f` of the script on every host and exit 1 a second later, and the
# job would end with no checkpoint. The first SIGTERM creates DFLASH_STOP_FILE instead (on the shared
# filesystem): global rank 0 sees it within a second and the job stops as on a SIGTERM to a rank (drafters
# checkpoint at an agreed step, every rank exits 75, and so does this script through pdsh -S and the runner). A second SIGTERM, or SIGINT / SIGHUP, goes to the runner: the hard stop. The runner
# gets a session of its own (setsid), so a signal to this script's process group reaches only this script.
setsid deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" --module dflash_ds.train "$@" &
LAUNCHER=$!
SIGNALLED=0
STOPPING=0
forward() { SIGNALLED=1; kill -s "$1" "$LAUNCHER" 2>/dev/null || true; }
graceful() {  # no bare `return` here: in a trap it returns wait's 143, and errexit would end the script
    SIGNALLED=1
    if ((STOPPING)); then
        forward TERM
    else
        STOPPING=1
        : > "$STOP_FILE"
        echo "[dflash-ds] SIGTERM: asked the job to stop (checkpoint, exit 75) through $STOP_FILE; a second" \
            "SIGTERM stops it at once" >&2
    fi
}
trap graceful TERM
trap 'forward INT' INT
trap 'forward HUP' HUP
STATUS=0
wait "$LAUNCHER" || STATUS=$?
while ((SIGNALLED)); do  # a trapped signal ends `wait` early: wait again for the launcher's own status
    SIGNALLED=0
    STATUS=0
    wait "$LAUNCHER" || STATUS=$?
done
if ((STATUS == 255)); then  # ssh's status for a session it ended or could not open
    echo "[dflash-ds] exit 255: pdsh lost its ssh session to a host (named above): it did not answer the keep-alives" \
        "($KEEPALIVE: its link is cut or it is gone) or ssh failed. The ranks' messages name the ranks lost;" \
        "--resume auto continues from the latest checkpoint" >&2
fi
exit "$STATUS"
