#!/usr/bin/env bash
# End-to-end demo on the CPU: tiny target -> drafter -> a few single-device training steps.
set -euo pipefail
OUT=${DEMO_OUT:-demo_out}
rm -rf "$OUT" && mkdir -p "$OUT"
echo "== 1. tiny target =="
dflash-ds make-tiny-target --out "$OUT/target"
echo "== 2. drafter init =="
dflash-ds init-drafter --target "$OUT/target" --out "$OUT/drafter_init" --num-layers 2 --block-size 8
echo "== 3. single-device training steps =="
dflash-ds train-step --target "$OUT/target" --drafter "$OUT/drafter_init" --steps 20
echo "demo: done; artifacts in $OUT/"
