#!/usr/bin/env bash
# One GPU, colocated training (issue 13): NCCL, bf16, flex_attention, DeepSpeed on CUDA, checkpoint,
# resume, export, eval. Called by launch/gpu_check.sh; runs alone too:
#
#   OUT=gpu_check_out/colocated bash launch/gpu_colocated.sh
#
# A Qwen3-family target of 12 layers, hidden 512 (make-tiny-target --family qwen3 --layers 12
# --hidden 512), 256 prepared conversations; 1 rank: 10 steps stopped by train.stop_at (checkpoint),
# resumed to 20 with an empty inductor cache (as on another node: the run's compile_cache/ is what it has); the
# resumed steps must equal an uninterrupted 20-step run's (bf16 on CUDA: within 1e-3, printed); the export is
# evaluated (lossless at temperature 0). Prints peak memory, tok/s and each run's seconds.
# WARMUP_ONLY=1: build the target and data, run 2 steps (compiling the run's flex graphs into the cache) and
# stop; KEEP_DATA=1: reuse the target and data already in $OUT (gpu_check.sh runs both, in that order).
set -euo pipefail
# Batch shapes change every step: the caching allocator's fixed-size segments would fragment (docs/MEMORY.md).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out/colocated}"
PY="${PYTHON:-python}"
# On a CPU box, to check the script itself: DEVICE=cpu DTYPE=fp32 LAYERS=4 HIDDEN=128 bash launch/gpu_colocated.sh
DEVICE="${DEVICE:-cuda}" DTYPE="${DTYPE:-bf16}" LAYERS="${LAYERS:-12}" HIDDEN="${HIDDEN:-512}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline

if [ "${KEEP_DATA:-0}" = 1 ] && [ -d "$OUT/prepared" ]; then
    rm -rf "$OUT/full" "$OUT/split" "$OUT/eval.json"
else
    rm -rf "$OUT" && mkdir -p "$OUT"
    "$PY" -m dflash_ds make-tiny-target --out "$OUT/target" --family qwen3 --layers "$LAYERS" --hidden "$HIDDEN"
    "$PY" - "$OUT" <<'PY'
import sys
from pathlib import Path
sys.path[:0] = ["tests", "tests/test_runtime"]
from runtime_utils import make_dataset  # the tests' conversation generator and the real prepare
make_dataset(Path(sys.argv[1]) / "target", Path(sys.argv[1]) / "prepared", n=256, max_length=512, block_size=16)
PY
fi
ARGS=(--config configs/tiny.yaml --target "$OUT/target" --data "$OUT/prepared" --colocate --no-wandb
      --max-steps 20 --train.save_interval 10 --train.log_interval 5 --data.token_budget 4096
      --data.max_length 512 --model.block_size 16 --train.dtype "$DTYPE")
# The launcher of this interpreter's torch (a bare `torchrun` may be another environment's).
run() { "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m dflash_ds.train "${ARGS[@]}" "$@"; }
if [ "${WARMUP_ONLY:-0}" = 1 ]; then
    rm -rf "$OUT/warmup" && run --output-dir "$OUT/warmup" --max-steps 2
    exit 0
fi
timed() { local what=$1 t0=$SECONDS; shift; "$@"; echo "[gpu_colocated] $what: $(( SECONDS - t0 )) s"; }
timed "uninterrupted 20 steps" run --output-dir "$OUT/full"
timed "10 steps, stopped" run --output-dir "$OUT/split" --train.stop_at 10
# The resume as on another node: an empty per-machine compile cache, the run's own (train.compile_cache) loaded
rm -rf "$OUT/fresh_inductor"
TORCHINDUCTOR_CACHE_DIR="$OUT/fresh_inductor" timed "resumed to 20, empty inductor cache" \
    run --output-dir "$OUT/split" --resume auto
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def recs(run):
    return {r["batch_id"]: r for r in map(json.loads, (out / run / "records" / "drafter0.jsonl").read_text().splitlines())}
full, split = recs("full"), recs("split")
assert sorted(full) == sorted(split) == list(range(20)), (sorted(full), sorted(split))
diff = max(abs(full[b]["loss"] - split[b]["loss"]) for b in full)
print(f"resumed vs uninterrupted: max |dloss| over 20 batches = {diff:.3g}")
last = json.loads((out / "full" / "metrics.jsonl").read_text().splitlines()[-1])
print(f"last window: loss {last['loss']:.4f}, {last['tok_per_sec']:,.0f} tok/s, peak {last['peak_mem_gb']} GB")
assert diff < 1e-3, diff
PY
"$PY" -m dflash_ds eval --target "$OUT/target" --drafter "$OUT/split/checkpoints/step_00000020/export" \
    --data "$OUT/prepared" --num-prompts 4 --max-new-tokens 32 --device "$DEVICE" --json "$OUT/eval.json"
"$PY" -c "import json; r = json.load(open('$OUT/eval.json')); print('eval lossless', r['lossless_checked'], 'mismatches', r['mismatches'], 'tau', r['tau']); assert r['lossless_checked'] and not r['mismatches']"
