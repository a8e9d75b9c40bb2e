#!/usr/bin/env bash
# The prepared one-GPU check: what this CPU-built project cannot show without a GPU.
#
#   OUT=gpu_check_out bash launch/gpu_check.sh        # every step has a timeout: 11.7 minutes at worst (below)
#   DEVICE=cpu bash launch/gpu_check.sh               # the script itself on a CPU box (CUDA-only parts skipped)
#
# Time, worst case (a fresh machine: no compile cache; a cold inductor/Triton compile is 40-70 s per flex
# graph, counted at 70): preflight 20 s; gpu_info 20; warmup 200 (target + data 30, start-up 30, 2 training graphs
# [2 batch classes, grad] x 70); colocated 140 (3 runs on the warm cache x 23, eval's no-grad graph 70);
# bench_memory 120 (Qwen3-8B shapes: 1 graph, fwd + bwd, 70; load and 3 widths 50); gpu_tests 200 (flex vs
# dense fp32 full and sliding, bf16: 3 tiny-shape graphs, fwd + bwd, x 60, imports 20).
# Sum 700 s = 11.7 min. The compile cache stays in bench_out/compile_cache (ignored by git, kept on the
# machine between calls): a rerun on the same machine recompiles nothing, ~3 min, so a cold run and a rerun
# fit 15 minutes of device time (14.7). gpu_check_2gpu.sh needs two GPUs (its own machine): its worst case is
# 9.5 min; both scripts' summed worst case is 1270 s = 21.2 min, never spent on one machine.
#
# 0. preflight (seconds; the script stops at once if it fails): C compiler, Python.h, /dev/shm, CUDA
#    available, device count, NCCL (launch/gpu_preflight.py). A CPU torch fails here, naming why.
# 1. the machine: nvidia-smi, torch / CUDA versions, free GPU memory; a warm-up compile of the colocated
#    run's graphs (a 2-step run), so the steps after it run on a warm cache;
# 2. `bench memory` for a Qwen3-8B-shaped drafter at the default config (5 layers, token budget
#    16384, 512 anchors/seq capped at 2048 per batch, chunk 64) in bf16 with flex_attention and
#    activation checkpointing: widths 256 and 512 and the full width 4096 (--full), measured peak
#    (max_memory_allocated) beside the formula's prediction, tokens/s and MFU (989 TFLOP/s dense bf16);
# 3. the unit tests that need CUDA (DFLASH_REQUIRE_GPU=1: a skipped one fails): compiled flex_attention vs
#    dense in fp32 and bf16; FULL=1 adds the inductor graph-bound walk, train-step bf16 and bench memory's
#    CUDA test (8+ more cold graphs: ~10 min more);
# 4. colocated training on the one GPU (launch/gpu_colocated.sh: NCCL, bf16, flex_attention,
#    DeepSpeed on CUDA, checkpoint, resume equal to an uninterrupted run, export, eval), whose metrics give
#    tokens/s, peak and reserved memory and the compiled graphs of the run.
# Outputs: $OUT/*.log, $OUT/bench_memory.json, $OUT/summary.json (per step: exit status, seconds, and
# compiled graphs, peak / reserved memory, tokens/s and MFU where the step measures them). A failed step
# does not stop the others; the script exits non-zero if any failed. The allocator runs with
# expandable segments (batch shapes vary: fixed-size segments fragment).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# One compile cache for every step and for a rerun: only the first compile of a graph is cold.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/bench_out/compile_cache/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/bench_out/compile_cache/triton}"
failed=0
: > "$OUT/steps.jsonl"

step() {  # step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to $OUT/NAME.log, record the status
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$OUT/steps.jsonl"
    if [ "$rc" -ne 0 ]; then failed=1; fi
}

skip() {  # skip NAME WHY
    echo "== $1: skipped ($2)"
    echo "{\"step\": \"$1\", \"skipped\": \"$2\"}" >> "$OUT/steps.jsonl"
}

if [ "$DEVICE" = cuda ]; then
    step preflight 20 "$PY" launch/gpu_preflight.py --gpus 1
    if [ "$failed" -ne 0 ]; then echo "gpu_check: preflight failed (above): not a machine this check can pass on"; exit 1; fi
    step gpu_info 20 bash -c "nvidia-smi; $PY -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda); \
print(torch.cuda.get_device_name(0), \"free/total GiB\", [round(x / 2**30, 1) for x in torch.cuda.mem_get_info(0)])'"
    step warmup 200 env OUT="$OUT/colocated" PYTHON="$PY" WARMUP_ONLY=1 bash launch/gpu_colocated.sh
    step colocated 140 env OUT="$OUT/colocated" PYTHON="$PY" KEEP_DATA=1 bash launch/gpu_colocated.sh
    step bench_memory 120 "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cuda --dtype bf16 --full \
        --json "$OUT/bench_memory.json"
    if [ "${FULL:-0}" = 1 ]; then
        GPU_TESTS=(tests/test_core/test_drafter_flex.py tests/test_core/test_flex_compiles.py
                   tests/test_core/test_single_step.py tests/test_bench/test_bench_memory.py)
        GPU_LIMIT=800
    else
        GPU_TESTS=(tests/test_core/test_drafter_flex.py) GPU_LIMIT=200
    fi
    step gpu_tests "$GPU_LIMIT" env DFLASH_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" \
        -k "cuda or gpu"
else
    skip gpu_info "DEVICE=$DEVICE: no CUDA"
    step bench_memory 220 "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cpu --widths 128 \
        --token-budget 1024 --num-anchors 16 --max-anchors 32 --seq-len 256 --json "$OUT/bench_memory.json"
    skip gpu_tests "DEVICE=$DEVICE: the CUDA unit tests skip without a GPU"
    step colocated 300 env OUT="$OUT/colocated" PYTHON="$PY" DEVICE=cpu DTYPE=fp32 LAYERS=4 HIDDEN=128 \
        bash launch/gpu_colocated.sh
fi

"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
bench = out / "bench_memory.json"
if bench.is_file() and "bench_memory" in steps:
    b = json.loads(bench.read_text())
    steps["bench_memory"]["figures"] = {
        "peak_kind": b.get("peak_kind"),
        "rows": [{"width": r["width"], "measured_peak_gb": r["measured_peak_bytes"] / 1e9,
                  "predicted_peak_gb": r["predicted_peak_bytes"] / 1e9, "error_pct": r.get("error_pct"),
                  "tokens_per_s": r.get("tokens_per_s"), "mfu": r.get("mfu")} for r in b.get("rows", [])],
        "full_width_total_gb": (b.get("full_width") or {}).get("total_bytes", 0) / 1e9}
metrics = out / "colocated" / "full" / "metrics.jsonl"
if metrics.is_file() and "colocated" in steps:
    last = json.loads(metrics.read_text().splitlines()[-1])
    steps["colocated"]["figures"] = {k: last.get(k) for k in ("tok_per_sec", "peak_mem_gb", "reserved_mem_gb",
                                                                "compiled_graphs", "step_time_s", "loss")}
summary = {"steps": list(steps.values())}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary))
PY
exit "$failed"
