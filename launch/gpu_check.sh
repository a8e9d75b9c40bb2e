#!/usr/bin/env bash
# The prepared one-GPU check: what this CPU-built project cannot show without a GPU, in one call of at most
# 8 minutes on a bare machine.
#
#   FULL=1 OUT=gpu_check_out bash launch/gpu_check.sh     # BUDGET_S=470 (default): steps stop or skip past it
#   STEPS=gpu_tests,bench_widths bash launch/gpu_check.sh # only those steps (a rerun on a warm machine)
#   DEVICE=cpu bash launch/gpu_check.sh                   # the script itself on a CPU box (CUDA-only parts skipped)
#   FUSE=both STEPS=bench_memory bash launch/gpu_check.sh # each bench row fused, then eager (train.fuse)
#
# A bare machine (torch with CUDA, no deepspeed/datasets): the wheelhouse `.whl/` (../shared/gpu/wheelhouse.sh
# .whl, carried with the checkout) is installed into $SITE first, offline. HF_HUB_OFFLINE=1 (compute nodes often
# have no internet) and no USE_HUB_KERNELS: every model load passes use_kernels=False (docs/DESIGN.md §9).
#
# Steps, in order of what they are worth (each with a timeout, all within BUDGET_S; a step with under 15 s of
# budget left is skipped and counts as failed). Steps 1-2 time the GPU and run alone; steps 3-5 check what is
# not a speed (their memory figures are per process) and run side by side, their logs shown once all end:
#  0. install (when needed; ~20 s), preflight (seconds; the script stops at once if it fails: C compiler,
#     Python.h, /dev/shm, CUDA, device count, NCCL), gpu_info (nvidia-smi, torch / CUDA, free memory);
#  1. bench_memory (230 s): `bench memory` at the Qwen3-8B preset's full width (5 layers, 16,384 tokens,
#     2,048 anchors, chunk 64, bf16, flex_attention) for dflash, dflash2 and dspark, checkpointing on and off on
#     the same build, fused (train.fuse's default on CUDA: the loss's passes, the layers' norms, RoPE and SwiGLU,
#     DFlash2's convolutions compiled; ~80 s more of cold compiles): step time, MFU / HFU, each kind against
#     DFlash, peak against the formula; the profile's top kernels ($OUT/profile.txt, .dflash2, .dspark). The
#     eager twin of each row: FUSE=both (twice the rows; a call of its own: FUSE=both STEPS=bench_memory);
#  2. real_shape (130 s): `bench real-shape`: a random Qwen3-8B target made on the GPU + the default drafter
#     in DeepSpeed ZeRO-2, colocated: tokens/s, MFU of each part, peak and reserved memory against plan;
#  3. warmup (90 s) + colocated (150 s): launch/gpu_colocated.sh (NCCL, bf16, flex_attention, DeepSpeed on
#     CUDA, checkpoint, resume equal to an uninterrupted run, export, eval): tokens/s, peak and reserved memory,
#     compiled graphs (its tok/s is of a tiny launch-bound model beside steps 4-5: not a speed figure);
#  4. gpu_tests (FULL=1: 180 s; else 100): the CUDA unit tests (DFLASH_REQUIRE_GPU=1: a skipped one fails);
#  5. bench_widths (110 s): `bench memory` at widths 256 and 512, checkpointing on and off (the memory model's
#     small-width error in both regimes).
# Steps 1 and 5 also write what is alive at each peak, by the line that allocated it ($OUT/memory_trace.txt,
# widths_memory_trace.txt: bench/memory_trace.py), to set against the model's terms where they disagree.
# Outputs: $OUT/*.log, $OUT/*.json, $OUT/summary.json (per step: exit status, seconds, figures) and
# $OUT/table.md (the table docs/BENCHMARKS.md shows: date, GPU, torch, each figure). A failed step does not
# stop the others; the script exits non-zero if any failed. Side by side, 3-5 take the longest of them (~240 s
# at most) where in a row they took ~500 s: the first FULL=1 run (2026-12-04) ran out of its 480 s in step 4. The allocator runs with expandable segments
# (batch shapes vary: fixed-size segments fragment). The compile cache stays in bench_out/compile_cache (ignored
# by git, kept on a warm machine between calls): a rerun recompiles nothing.
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
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
BUDGET_S="${BUDGET_S:-470}"
STEPS="${STEPS:-all}"
failed=0
: > "$OUT/steps.jsonl"

wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }

step() {  # step NAME TIMEOUT_S CMD...: run CMD under a timeout within the budget, log to $OUT/NAME.log
    local name=$1 limit=$2 rc=0 t0=$SECONDS left=$((BUDGET_S - SECONDS))
    shift 2
    wanted "$name" || return 0
    if [ "$left" -lt 15 ]; then
        echo "== $name: skipped (budget: ${left}s left of ${BUDGET_S}s)"
        echo "{\"step\": \"$name\", \"skipped\": \"budget\", \"exit\": 124}" >> "$OUT/steps.jsonl"
        failed=1
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    if [ -n "${SIDE:-}" ]; then echo "== $name: exit $rc after $((SECONDS - t0))s"; else tail -n 30 "$OUT/$name.log"; fi
    echo "{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$OUT/steps.jsonl"
    if [ "$rc" -ne 0 ]; then failed=1; fi
}

# Side by side: `side CMD...` runs CMD (steps) in a subshell in the background; `join NAME...` waits for them all
# and shows those steps' log tails. A step's record is one line appended to steps.jsonl (an atomic write).
SIDE_PIDS=()
side() { ( SIDE=1; "$@"; exit "$failed" ) & SIDE_PIDS+=("$!"); }
join() {
    local pid name
    for pid in "${SIDE_PIDS[@]}"; do wait "$pid" || failed=1; done
    SIDE_PIDS=()
    for name in "$@"; do
        [ -f "$OUT/$name.log" ] && { echo "== $name (log tail)"; tail -n 30 "$OUT/$name.log"; }
    done
    return 0
}

skip() {  # skip NAME WHY
    echo "== $1: skipped ($2)"
    echo "{\"step\": \"$1\", \"skipped\": \"$2\"}" >> "$OUT/steps.jsonl"
}

# A bare machine: the project's pinned packages from the carried wheelhouse, offline, before anything imports them.
WHEELS="${WHEELHOUSE:-.whl}"
if ! "$PY" -c "import deepspeed, datasets" 2>/dev/null && compgen -G "$WHEELS/*.whl" > /dev/null; then
    SITE="${SITE:-/tmp/dflash-site}"
    STEPS=all step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi

if [ "$DEVICE" = cuda ]; then
    step preflight 20 "$PY" launch/gpu_preflight.py --gpus 1
    if [ "$failed" -ne 0 ]; then echo "gpu_check: preflight failed (above): not a machine this check can pass on"; exit 1; fi
    step gpu_info 20 bash -c "nvidia-smi; $PY -c 'import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__); \
print(torch.cuda.get_device_name(0), \"free/total GiB\", [round(x / 2**30, 1) for x in torch.cuda.mem_get_info(0)])'"
    BENCH_LIMIT=230; [ "${FUSE:-auto}" = both ] && BENCH_LIMIT=400  # both: twice the rows
    step bench_memory "$BENCH_LIMIT" "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cuda --dtype bf16 --widths 4096 \
        --kind dflash,dflash2,dspark --activation-checkpointing both --fuse "${FUSE:-auto}" --profile "$OUT/profile.txt" \
        --memory-trace "$OUT/memory_trace.txt" --json "$OUT/bench_memory.json"
    step real_shape 130 "$PY" -m dflash_ds bench real-shape --preset qwen3-8b --json "$OUT/real_shape.json"
    colocated_chain() {
        step warmup 90 env OUT="$OUT/colocated" PYTHON="$PY" WARMUP_ONLY=1 bash launch/gpu_colocated.sh
        step colocated 150 env OUT="$OUT/colocated" PYTHON="$PY" KEEP_DATA=1 bash launch/gpu_colocated.sh
    }
    side colocated_chain
    if [ "${FULL:-0}" = 1 ]; then
        GPU_TESTS=(tests/test_core/test_drafter_flex.py tests/test_core/test_flex_compiles.py
                   tests/test_core/test_single_step.py tests/test_bench/test_bench_memory.py
                   tests/test_core/test_fusion.py tests/test_models/test_drafter_build.py)
        GPU_LIMIT=180
    else
        GPU_TESTS=(tests/test_core/test_drafter_flex.py) GPU_LIMIT=100
    fi
    side step gpu_tests "$GPU_LIMIT" env DFLASH_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider "${GPU_TESTS[@]}" \
        -k "cuda or gpu"
    side step bench_widths 110 "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cuda --dtype bf16 \
        --widths 256,512 --activation-checkpointing both --memory-trace "$OUT/widths_memory_trace.txt" \
        --json "$OUT/bench_widths.json"
    join warmup colocated gpu_tests bench_widths
else
    skip gpu_info "DEVICE=$DEVICE: no CUDA"
    step bench_memory 220 "$PY" -m dflash_ds bench memory --preset qwen3-8b --device cpu --widths 128 \
        --token-budget 1024 --num-anchors 16 --max-anchors 32 --seq-len 256 --kind dflash,dflash2,dspark \
        --profile "$OUT/profile.txt" --json "$OUT/bench_memory.json"
    skip gpu_tests "DEVICE=$DEVICE: the CUDA unit tests skip without a GPU"
    # side by side here too (the same code path as on a GPU; no figure of a CPU check is a speed)
    side step real_shape 120 "$PY" -m dflash_ds bench real-shape --device cpu --width 128 --target-layers 6 \
        --vocab 512 --token-budget 1024 --seq-len 256 --num-anchors 8 --steps 1 --warmup 1 --json "$OUT/real_shape.json"
    side step colocated 300 env OUT="$OUT/colocated" PYTHON="$PY" DEVICE=cpu DTYPE=fp32 LAYERS=4 HIDDEN=128 \
        bash launch/gpu_colocated.sh
    join real_shape colocated
fi

gzip -f "$OUT"/profile.txt*.trace.json 2>/dev/null  # Chrome traces of one step: tens of MB, ~10x smaller
"$PY" launch/gpu_summary.py "$OUT" --budget "$BUDGET_S" --seconds "$SECONDS"
exit "$failed"
