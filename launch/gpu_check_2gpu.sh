#!/usr/bin/env bash
# The prepared two-GPU check: what a one-GPU machine cannot show. Two NCCL ranks cannot share one GPU
# ("Duplicate GPU detected"), so the hidden-state bridge (target rank -> drafter rank over NCCL) runs only here.
#
#   OUT=gpu_check_2gpu_out bash launch/gpu_check_2gpu.sh      # every step has a timeout: 9.5 minutes at worst
#   DEVICE=cpu DTYPE=fp32 LAYERS=4 HIDDEN=128 bash launch/gpu_check_2gpu.sh   # the script itself, on a CPU box
#
# Time, worst case (a fresh machine, no compile cache; a cold inductor/Triton compile is 40-70 s per flex
# graph, counted at 70): preflight 20 s, gpu_info 20, bench_comm 45, data 45, warmup 200 (start-up 40,
# 2 training graphs [2 batch classes, grad] x 70, margin 20), then on the warm cache train_full, train_stop,
# train_resume 45 each (start-up ~30, 20 tiny steps), compare 10, sigterm 45, sigterm_checked 5,
# sigterm_resume 45. Sum 570 s = 9.5 min; a rerun on the same machine (cache in bench_out/compile_cache)
# compiles nothing: ~4 min, 13.5 in all, inside 15 minutes of device time. With gpu_check.sh (700 s, one GPU,
# its own machine) both scripts' summed worst case is 1270 s = 21.2 min, never spent on one machine.
#
# 0. preflight (seconds; the script stops at once if it fails): C compiler, Python.h, /dev/shm, CUDA
#    available, 2 devices, NCCL (launch/gpu_preflight.py). A CPU torch fails here, naming why.
# 1. the machine (nvidia-smi, torch / CUDA / NCCL versions); a 2-step warm-up run compiles the graphs;
# 2. `bench comm` between the two ranks: raw send/recv vs the training exchange, 64 KiB .. 256 MiB;
# 3. disaggregated training, 1 target rank + 1 drafter rank (NCCL bridge, bf16, flex_attention, DeepSpeed
#    ZeRO-2 on CUDA): 20 steps uninterrupted; the same run stopped by train.stop_at 10 and resumed: the
#    resumed batches' losses must equal the uninterrupted run's (bf16: within 1e-3);
# 4. SIGTERM to the target rank mid-run: every rank exits with status 75 and the checkpoint resumes.
# Outputs: $OUT/*.log and $OUT/summary.json (per step: exit status, seconds, and the figures it printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_2gpu_out}"
PY="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}" DTYPE="${DTYPE:-bf16}" LAYERS="${LAYERS:-12}" HIDDEN="${HIDDEN:-512}"
rm -rf "$OUT" && mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# One compile cache for every step and for a rerun (outside $OUT, which is cleared): only the first is cold.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/bench_out/compile_cache/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/bench_out/compile_cache/triton}"
failed=0
: > "$OUT/steps.jsonl"

step() {  # step NAME EXPECTED_EXIT TIMEOUT_S CMD...: run CMD under a timeout, log to $OUT/NAME.log, record it
    local name=$1 want=$2 limit=$3 rc=0 t0=$SECONDS
    shift 3
    echo "== $name (timeout ${limit}s, expecting exit $want)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "{\"step\": \"$name\", \"exit\": $rc, \"expected\": $want, \"seconds\": $((SECONDS - t0))}" >> "$OUT/steps.jsonl"
    if [ "$rc" -ne "$want" ]; then failed=1; fi
}

if [ "$DEVICE" = cuda ]; then
    step preflight 0 20 "$PY" launch/gpu_preflight.py --gpus 2
    if [ "$failed" -ne 0 ]; then echo "gpu_check_2gpu: preflight failed (above): not a machine this check can pass on"; exit 1; fi
    step gpu_info 0 20 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.nccl.version(), torch.cuda.device_count())'"
else
    echo "== gpu_info: skipped (DEVICE=$DEVICE: no CUDA)"
    echo '{"step": "gpu_info", "skipped": "no CUDA"}' >> "$OUT/steps.jsonl"
fi

SIZES=$([ "$DEVICE" = cuda ] && echo "64K,1M,16M,256M" || echo "64K,1M,16M")
# The launcher of this interpreter's torch (a bare `torchrun` may be another environment's).
RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2)
step bench_comm 0 45 "${RUN[@]}" -m dflash_ds bench comm --num-target-ranks 1 \
    --sizes "$SIZES" --rounds 1 --json

step data 0 45 bash -c "$PY -m dflash_ds make-tiny-target --out $OUT/target --family qwen3 --layers $LAYERS \
--hidden $HIDDEN && $PY - $OUT <<'PY'
import sys
from pathlib import Path
sys.path[:0] = ['tests', 'tests/test_runtime']
from runtime_utils import make_dataset  # the tests' conversation generator and the real prepare
make_dataset(Path(sys.argv[1]) / 'target', Path(sys.argv[1]) / 'prepared', n=256, max_length=512, block_size=16)
PY"

ARGS=(--config configs/tiny.yaml --target "$OUT/target" --data "$OUT/prepared" --num-target-ranks 1 --no-wandb
      --max-steps 20 --train.save_interval 10 --train.log_interval 5 --data.token_budget 4096
      --data.max_length 512 --model.block_size 16 --train.dtype "$DTYPE")
TRAIN=("${RUN[@]}" -m dflash_ds.train "${ARGS[@]}")
step warmup 0 200 "${TRAIN[@]}" --output-dir "$OUT/warmup" --max-steps 2
step train_full 0 45 "${TRAIN[@]}" --output-dir "$OUT/full"
step train_stop 0 45 "${TRAIN[@]}" --output-dir "$OUT/split" --train.stop_at 10
step train_resume 0 45 "${TRAIN[@]}" --output-dir "$OUT/split" --resume auto
step compare 0 10 "$PY" -c '
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def recs(run):
    return {r["batch_id"]: r for r in map(json.loads, (out / run / "records" / "drafter0.jsonl").read_text().splitlines())}
full, split = recs("full"), recs("split")
assert sorted(full) == sorted(split) == list(range(20)), (sorted(full), sorted(split))
diff = max(abs(full[b]["loss"] - split[b]["loss"]) for b in full)
last = json.loads((out / "full" / "metrics.jsonl").read_text().splitlines()[-1])
print(json.dumps({"resume_max_dloss": diff, "tok_per_sec": last["tok_per_sec"], "peak_mem_gb": last["peak_mem_gb"],
                  "loss": last["loss"]}))
assert diff < 1e-3, diff
' "$OUT"

# SIGTERM to the target rank (global rank 1: drafters first) as it starts step 6: the drafters stop at an agreed
# step and checkpoint it, the target exits 75 (torchrun itself then reports a failed child: exit 1), and the
# checkpoint resumes.
step sigterm 1 45 env DFLASH_FAULT_RANK=1 DFLASH_FAULT_TERM_AT=6 "${TRAIN[@]}" --output-dir "$OUT/term"
# Every rank's status as torchrun reports it ("exitcode  : 75" for both ranks; a rank it had to SIGKILL shows -9,
# so finding one 75 is not enough).
step sigterm_checked 0 5 "$PY" -c '
import re, sys
from pathlib import Path
log = Path(sys.argv[1]).read_text()
codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", log))
print(codes)
assert codes == {"0": "75", "1": "75"}, codes
assert list(Path(sys.argv[2]).glob("step_*")), "no checkpoint"
' "$OUT/sigterm.log" "$OUT/term/checkpoints"
step sigterm_resume 0 45 "${TRAIN[@]}" --output-dir "$OUT/term" --resume auto

"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
for s in steps:  # the last JSON line a step printed: its figures
    log = out / f"{s['step']}.log"
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")] if log.exists() else []
    if lines:
        try:
            s["figures"] = json.loads(lines[-1])
        except ValueError:
            pass
(out / "summary.json").write_text(json.dumps({"steps": steps}, indent=2) + "\n")
print(json.dumps({"steps": [{k: v for k, v in s.items() if k != "figures"} for s in steps]}))
PY
exit "$failed"
