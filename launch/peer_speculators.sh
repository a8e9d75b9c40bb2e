#!/usr/bin/env bash
# dflash-ds and vLLM's speculators (0.9.0) train a DFlash drafter on the same work, on CPU, and one engine serves
# both (docs/QUALITY.md "A peer trainer: speculators"): the quality target, its 480 regenerated conversations as
# dflash-ds prepared them, 2 layers reading target layers [1, 2], block 8, 2,048-token batches, 150 steps, one seed.
#   PEER_PY   python of an environment with speculators==0.9.0, torch==2.13.0 (CPU), transformers==5.19.0 and no
#             torchvision/torchaudio (the registry's builds break the CPU torch import); never dflash-ds's venv
#   Q         a folder holding target/, prepared/ and eval.jsonl as docs/QUALITY.md's recipe-table commands make them
set -euo pipefail
PEER_PY=${PEER_PY:?set PEER_PY to the peer environment python}
Q=${Q:?set Q to the quality folder}
OUT=${OUT:-$Q/peer}; SEED=${SEED:-0}; STEPS=${STEPS:-150}
HERE=$(cd "$(dirname "$0")" && pwd)
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT"

echo "== dflash-ds: configs/tiny.yaml, $STEPS steps, seed $SEED (bench recipe trains and evaluates)"
printf -- '- name: ce_decay\n  set: {}\n' > "$OUT/ce_decay.yaml"
dflash-ds bench recipe --recipes "$OUT/ce_decay.yaml" --config "$HERE/../configs/tiny.yaml" --target "$Q/target" \
    --data "$Q/prepared" --eval-data "$Q/eval.jsonl" --seeds "$SEED" --steps "$STEPS" --max-new-tokens 48 \
    --out "$OUT/dflash_ds"
EXPORT=$(ls -d "$OUT"/dflash_ds/ce_decay/seed"$SEED"/checkpoints/step_*"$STEPS"/export | tail -1)

echo "== speculators: the same rows, hidden states, $STEPS steps, seed $SEED"
cd "$OUT"
[ -f rows.jsonl ] || "$PEER_PY" "$HERE/peer_speculators.py" rows "$Q/prepared" rows.jsonl
[ -d data ] || "$PEER_PY" -m speculators prepare-data --model "$Q/target" --data rows.jsonl --output data \
    --seq-length 128 --seed 0 --num-preprocessing-workers 1
[ -d data/hidden_states ] || "$PEER_PY" "$HERE/peer_speculators.py" hidden-states "$Q/target" data 2,3
EPOCHS=$("$PEER_PY" "$HERE/peer_speculators.py" epochs data "$STEPS" "$SEED" 0.99)
rm -rf "ckpt_s$SEED"
start=$SECONDS
# The recipe of configs/tiny.yaml in the peer's flags (AdamW 3e-3, 10 warm-up steps, cosine, CE with position decay
# gamma 4); sdpa and eager loss because FlexAttention has no CPU backward and the fused loss needs Triton.
"$PEER_PY" "$HERE/peer_speculators.py" train --speculator-type dflash --verifier-name-or-path "$Q/target" \
    --data-path data --num-layers 2 --block-size 8 --target-layer-ids 2 3 --full-attention-indices 0 1 \
    --total-seq-len 2048 --max-anchors 512 --num-workers 0 --max-steps "$STEPS" --epochs "$EPOCHS" --seed "$SEED" \
    --train-data-ratio 0.99 --hidden-states-dtype float32 --draft-attn-impl sdpa --loss-implementation eager \
    --on-missing raise --optimizer adamw --lr 3e-3 --weight-decay 0.0 --scheduler-type cosine \
    --scheduler-warmup-steps 10 --loss-fn ce --per-position-loss-weight fixed-exp-decay --dflash-decay-gamma 4 \
    --log-dir "logs_s$SEED" --save-path "ckpt_s$SEED" > "train_s$SEED.log" 2>&1
echo "speculators train: $((SECONDS - start)) s"
LAST=$(ls -d "ckpt_s$SEED"/[0-9]* | sort -t/ -k2 -n | tail -1)
"$PEER_PY" "$HERE/peer_speculators.py" to-export "$LAST" "$EXPORT" "export_s$SEED"

echo "== one engine, the same 16 held-out prompts, 48 new tokens, greedy (lossless-checked)"
for drafter in "$EXPORT" "$OUT/export_s$SEED"; do
    dflash-ds eval --target "$Q/target" --drafter "$drafter" --data "$Q/eval.jsonl" --num-prompts 16 \
        --max-new-tokens 48 --json "$drafter.eval.json" | tail -n 3
done
