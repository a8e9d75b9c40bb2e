"""`dflash-ds bench curve`: held-out tau against training tokens, from the checkpoints a run kept.

    dflash-ds bench recipe ... --steps 600 --save-interval 75 --set train.keep_last=8 --out q/long
    dflash-ds bench curve --runs q/long/*/seed0 --target q/target --eval-data q/eval.jsonl --max-new-tokens 48

Every `checkpoints/step_*/export` of each run folder (a `bench recipe` run or any training output folder) is
evaluated on the same held-out prompts by real speculative decoding (greedy, lossless-checked, as `bench recipe`
and `eval` do); the training tokens at a checkpoint are the sum of `real_tokens` over the run's records up to its
step (metrics.jsonl). Each evaluation is kept in the run's `curve/step_<N>.json` and not repeated, so a curve
grows as the run trains. Prints one line per (run, checkpoint), writes the JSON summary and a plot of tau against
tokens, one line per run. What a point costs: one evaluation (16 prompts x 48 tokens on the quality target:
~10 s on one CPU core); keep the checkpoints a curve needs (`train.keep_last`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError

STEP_DIR = re.compile(r"step_(\d+)$")


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, export folder) of each checkpoint a run kept, by step."""
    found = []
    for d in (run / "checkpoints").glob("step_*"):
        m = STEP_DIR.search(d.name)
        if m and (d / "export" / "config.json").is_file():
            found.append((int(m.group(1)), d / "export"))
    return sorted(found)


def tokens_by_step(run: Path) -> dict[int, int]:
    """Training tokens up to each recorded step: the running sum of the records' `real_tokens`."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise DFlashError(f"{path}: missing (is {run} a training output folder?)")
    total, out = 0, {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            total += int(rec.get("real_tokens", 0))
            out[int(rec["step"])] = total
    return out


def point(run: Path, step: int, export: Path, target, prompts, args: argparse.Namespace) -> dict[str, Any]:
    """One checkpoint's held-out figures, read from curve/step_<N>.json when an earlier curve evaluated it alike."""
    from dflash_ds.eval.cli import evaluate
    from dflash_ds.models.drafter import DFlashDrafter

    done = run / "curve" / f"step_{step:08d}.json"
    key = {"eval_data": str(Path(args.eval_data).resolve()), "num_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens}
    if done.is_file():
        earlier = json.loads(done.read_text())
        if earlier.get("settings") == key:
            return earlier
    res = evaluate(target, DFlashDrafter.from_pretrained(export).eval(), prompts, max_new_tokens=args.max_new_tokens,
                   temperature=0.0, seed=0, log=lambda _s: None)
    if res["mismatches"]:
        raise DFlashError(f"{export}: speculative output differs from greedy decoding")
    result = {"step": step, "tau": res["tau"], "tau_pooled": res["tau_pooled"],
              "per_position_acceptance": res["per_position_acceptance"], "settings": key}
    done.parent.mkdir(exist_ok=True)
    done.with_suffix(".tmp").write_text(json.dumps(result, indent=2) + "\n")
    os.replace(done.with_suffix(".tmp"), done)
    return result


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([p["tokens"] for p in pts], [p["tau"] for p in pts], "o-", ms=3, label=name)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out tau")
    ax.set_ylim(bottom=1.0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", nargs="+", required=True, help="training output folders (a bench recipe run: "
                        "OUT/<recipe>/seed<S>) whose kept checkpoints make the curve")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--eval-data", required=True, help="held-out prompts: a .jsonl conversation file or a "
                        "prepared dataset")
    parser.add_argument("--num-prompts", type=int, default=16, help="held-out prompts evaluated (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the evaluation (default 1)")
    parser.add_argument("--out", default="bench_out/curve", help="summary (curve.json) and plot (curve.png) folder "
                        "(default bench_out/curve)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object (last line)")


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash_ds.eval.cli import load_prompts
    from dflash_ds.models.target import load_target

    runs = [Path(r) for r in args.runs]
    found = {r: checkpoints(r) for r in runs}
    for r, ckpts in found.items():
        if not ckpts:
            raise DFlashError(f"{r}: no checkpoint with an export (checkpoints/step_*/export): nothing to evaluate")
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.eval_data, args.target, args.num_prompts)
    target = load_target(args.target)
    common = os.path.commonpath([str(r.resolve()) for r in runs]) if len(runs) > 1 else str(runs[0].resolve().parent)
    curves: dict[str, list[dict]] = {}
    for r, ckpts in found.items():
        name = os.path.relpath(r.resolve(), common)
        tokens = tokens_by_step(r)
        curves[name] = []
        for step, export in ckpts:
            p = {**point(r, step, export, target, prompts, args), "tokens": tokens.get(step)}
            curves[name].append(p)
            tok = "?" if p["tokens"] is None else f"{p['tokens']:,}"
            print(f"bench curve: {name} step {step}: {tok} tokens, held-out tau {p['tau']:.3f} "
                  f"(pooled {p['tau_pooled']:.3f})", file=sys.stderr if args.json else sys.stdout, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"curves": curves, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "best": max(({"run": n, **p} for n, pts in curves.items() for p in pts), key=lambda p: p["tau"])}
    (out / "curve.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot({n: [p for p in pts if p["tokens"] is not None] for n, pts in curves.items()}, out / "curve.png")
    if args.json:
        print(json.dumps(summary))
    else:
        b = summary["best"]
        print(f"bench curve: best held-out tau {b['tau']:.3f} ({b['run']} step {b['step']}); "
              f"summary -> {out / 'curve.json'}, plot -> {out / 'curve.png'}")
    return 0
