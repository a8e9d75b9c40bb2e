#!/usr/bin/env bash
# The prepared one-GPU check (issue 11 item 8): what this CPU-built project cannot show without a GPU.
#
#   OUT=gpu_check_out bash launch/gpu_check.sh        # every step has a timeout: 9.5 minutes at worst
#
# 1. the machine: nvidia-smi, torch / CUDA versions, free GPU memory;
# 2. `bench memory` for a Qwen3-8B-shaped drafter at the default config (5 layers, token budget
#    16384, 512 anchors/seq capped at 2048 per batch, chunk 64) in bf16 with flex_attention and
#    activation checkpointing: widths 256 and 512 and the full width 4096 (--full), measured peak
#    (max_memory_allocated) beside the formula's prediction, tokens/s and MFU (989 TFLOP/s dense bf16);
# 3. the unit tests that need CUDA (compiled flex_attention vs dense, train-step in bf16 on CUDA,
#    bench memory on CUDA); on a CPU-only machine they are skipped;
# 4. colocated training on the one GPU (launch/gpu_colocated.sh: NCCL, bf16, flex_attention,
#    DeepSpeed on CUDA, checkpoint, resume equal to an uninterrupted run, export, eval).
# Outputs: $OUT/*.log, $OUT/bench_memory.json, $OUT/summary.txt. A failed step does not stop the
# others; the script exits non-zero if any failed.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
: > "$OUT/summary.txt"

step() {  # step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to $OUT/NAME.log, record the status
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ]; then failed=1; fi
}

step gpu_info 20 bash -c "nvidia-smi; $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0), \"free/total GiB\", \
[round(x / 2**30, 1) for x in torch.cuda.mem_get_info(0)])'"

step bench_memory 220 "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cuda --dtype bf16 --full \
    --json "$OUT/bench_memory.json"

step gpu_tests 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_core/test_drafter_flex.py \
    tests/test_core/test_single_step.py tests/test_bench/test_bench_memory.py -k "cuda or gpu"

step colocated 150 env OUT="$OUT/colocated" PYTHON="$PY" bash launch/gpu_colocated.sh

echo "== summary"
cat "$OUT/summary.txt"
exit "$failed"
