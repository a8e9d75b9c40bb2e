#!/usr/bin/env bash
# dflash-ds and vLLM's speculators (0.9.0) on the real target, on CPU (docs/QUALITY.md "The peer on the real
# target"): SmolLM2-135M-Instruct's own 32-token answers to `make-prompts`' first 192 training prompts, both trainers
# on the same rows, drafter shape (2 layers reading target layers [1, 27], block 4, mask token 16), step count
# (800), batch tokens (384), anchors (8 a row: 40 a 384-token batch) and seed, configs/real_smollm2.yaml's recipe in
# the peer's flags; one engine (`dflash-ds eval`, greedy, lossless-checked) serves both exports on the held-out
# prompts, and dflash-ds's kept checkpoints (steps 400, 800) on the first training prompts too (est_tau's estimand).
#   PEER_PY  python of the peer's environment (launch/peer_speculators.sh says how it is made)
#   R        a folder with train_prepared/, held_prepared/ (dflash-ds prepare of the answers), train.jsonl and
#            held_out.jsonl (the prompts, as `bench kinds` writes them in its --out)
#   TARGET   the SmolLM2 folder (`make real-target`); SEED (0), STEPS (800), HELD (16) and TRAIN (32) prompts served
set -euo pipefail
PEER_PY=${PEER_PY:?set PEER_PY to the peer environment python}
R=${R:?set R to the data folder}
TARGET=${TARGET:?set TARGET to the SmolLM2 folder}
SEED=${SEED:-0}; STEPS=${STEPS:-800}; HELD=${HELD:-16}; TRAIN=${TRAIN:-32}; TOKENS=384; ANCHORS=40
HERE=$(cd "$(dirname "$0")" && pwd)
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
cd "$R"

RUN=dflash_ds_s$SEED
EXPORT=$RUN/checkpoints/step_$(printf '%08d' "$STEPS")/export
if [ ! -d "$EXPORT" ]; then
    echo "== dflash-ds: configs/real_smollm2.yaml, $STEPS steps, seed $SEED"
    start=$SECONDS
    torchrun --standalone --nproc_per_node 1 -m dflash_ds.train --config "$HERE/../configs/real_smollm2.yaml" \
        --target "$TARGET" --data train_prepared --data.val_path held_prepared --output-dir "$RUN" \
        --train.seed "$SEED" --max-steps "$STEPS" > "$RUN.log" 2>&1
    echo "dflash-ds train: $((SECONDS - start)) s"
fi

echo "== speculators: the same rows and hidden states, $STEPS steps of $TOKENS tokens, seed $SEED"
mkdir -p peer && cd peer
[ -f rows.jsonl ] || "$PEER_PY" "$HERE/peer_speculators.py" rows ../train_prepared rows.jsonl
[ -d data ] || "$PEER_PY" -m speculators prepare-data --model "$TARGET" --data rows.jsonl --output data \
    --seq-length 256 --seed 0 --num-preprocessing-workers 1
[ -d data/hidden_states ] || "$PEER_PY" "$HERE/peer_speculators.py" hidden-states "$TARGET" data 2,28
EPOCHS=$("$PEER_PY" "$HERE/peer_speculators.py" epochs data "$STEPS" "$SEED" 0.99 "$TOKENS")
if [ ! -d "export_s$SEED" ]; then
    rm -rf "ckpt_s$SEED"
    start=$SECONDS
    "$PEER_PY" "$HERE/peer_speculators.py" train --speculator-type dflash --verifier-name-or-path "$TARGET" \
        --data-path data --num-layers 2 --block-size 4 --target-layer-ids 2 28 --full-attention-indices 0 1 \
        --mask-token-id 16 --total-seq-len "$TOKENS" --max-anchors "$ANCHORS" --num-workers 0 --max-steps "$STEPS" \
        --epochs "$EPOCHS" --seed "$SEED" --train-data-ratio 0.99 --hidden-states-dtype float32 --draft-attn-impl sdpa \
        --loss-implementation eager --on-missing raise --optimizer adamw --lr 3e-3 --weight-decay 0.0 \
        --scheduler-type cosine --scheduler-warmup-steps 10 --loss-fn ce --per-position-loss-weight fixed-exp-decay \
        --dflash-decay-gamma 4 --log-dir "logs_s$SEED" --save-path "ckpt_s$SEED" > "train_s$SEED.log" 2>&1
    echo "speculators train: $((SECONDS - start)) s"
    LAST=$(ls -d "ckpt_s$SEED"/[0-9]* | sort -t/ -k2 -n | tail -1)
    "$PEER_PY" "$HERE/peer_speculators.py" to-export "$LAST" "../$EXPORT" "export_s$SEED"
fi
cd ..

echo "== one engine: $HELD held-out prompts (both), $TRAIN training prompts (dflash-ds's kept checkpoints: est_tau's"
echo "   estimand), 32 new tokens, greedy, lossless-checked"
for drafter in "$EXPORT" "peer/export_s$SEED"; do
    [ -f "$drafter.held.json" ] || dflash-ds eval --target "$TARGET" --drafter "$drafter" --data held_out.jsonl \
        --num-prompts "$HELD" --max-new-tokens 32 --json "$drafter.held.json" | tail -n 2
done
for ckpt in "$RUN"/checkpoints/step_*/export; do
    [ -f "$ckpt.held.json" ] || dflash-ds eval --target "$TARGET" --drafter "$ckpt" --data held_out.jsonl \
        --num-prompts "$HELD" --max-new-tokens 32 --json "$ckpt.held.json" | tail -n 2
    [ -f "$ckpt.train.json" ] || dflash-ds eval --target "$TARGET" --drafter "$ckpt" --data train.jsonl \
        --num-prompts "$TRAIN" --max-new-tokens 32 --json "$ckpt.train.json" | tail -n 2
done
