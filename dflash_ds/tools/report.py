"""`dflash-ds report`: PNG plots and a text summary of a training run's metrics.jsonl.

Writes one PNG per metric found (`<metric>.png`, the metric against step) into `RUN/plots/`, the
acceptance figures on one plot (`acceptance.png`: training tau, est_tau, val_tau, val_est_tau,
alpha_tau, whichever the run logged), plus `summary.txt` with first / last / best values (and, for
the acceptance figures, the mean of the last records), the step range and tokens/s. matplotlib runs
with the Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError

# metric -> (title, which way is better: "min", "max" or None when "best" means nothing, e.g. queue depth)
METRICS: dict[str, tuple[str, str | None]] = {
    "loss": ("training loss", "min"),
    "accuracy": ("accuracy (argmax == label)", "max"),
    "tau": ("training acceptance length tau (1 + mean streak over the batch's blocks)", "max"),
    "est_tau": ("est_tau: the greedy anchor walk, as decoding visits blocks", "max"),
    "val_tau": ("val_tau: tau on the validation split", "max"),
    "val_est_tau": ("val_est_tau: est_tau on the validation split (checkpoints/best)", "max"),
    "alpha": ("alpha: sum over the vocabulary of min(p_draft, p_target)", "max"),
    "alpha_tau": ("alpha_tau: expected accepted length, sampling with sampled drafts", "max"),
    "argmax_alpha": ("argmax_alpha: p_target(the drafter's argmax)", "max"),
    "argmax_alpha_tau": ("argmax_alpha_tau: expected accepted length, sampling with argmax drafts", "max"),
    "grad_norm": ("gradient norm", None),
    "lr": ("learning rate", None),
    "tok_per_sec": ("tokens / s", "max"),
    "hs_queue_depth": ("hidden-state queue depth", None),
    "padding_efficiency": ("padding efficiency (real / padded tokens)", "max"),
    "peak_mem_gb": ("peak device memory of a drafter rank (GB)", None),
}
# The acceptance-length figures drawn together on acceptance.png: which one predicts serving is in
# docs/QUALITY.md (est_tau / val_est_tau for greedy decoding; for sampling argmax_alpha_tau with argmax drafts,
# the serving engines' default, alpha_tau with sampled drafts; tau overstates).
ACCEPTANCE = ("tau", "est_tau", "val_tau", "val_est_tau", "alpha_tau", "argmax_alpha_tau")
LAST_K = 10
ACCEPTANCE_NOTE = ("served acceptance: est_tau (val_est_tau on held-out rows) predicts eval's greedy tau, "
                   "argmax_alpha_tau the sampled one with argmax drafts (vLLM's and SGLang's default), alpha_tau with "
                   "sampled drafts; tau, the argmax streak at uniform anchors, overstates them (docs/QUALITY.md)")


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a metrics.jsonl (sorted by step) and the number of unreadable lines skipped."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path}: no such file (a training run writes metrics.jsonl into its output folder)")
    records, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1  # a torn last line from a crash must not hide the rest of the run
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            records.append(rec)
        else:
            skipped += 1
    if not records:
        raise DFlashError(f"{path}: no metric records (empty, or no line with a numeric 'step')")
    records.sort(key=lambda r: r["step"])
    return records, skipped


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(float(r["step"]))
            values.append(float(v))
    return steps, values


def plot_metrics(records: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per metric present in the records; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, (title, _) in METRICS.items():
        steps, values = _series(records, key)
        if not values:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot(steps, values, marker="." if len(values) < 50 else None, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    curves = [(key, *_series(records, key)) for key in ACCEPTANCE]
    curves = [c for c in curves if c[2]]
    if len(curves) > 1:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for key, steps, values in curves:  # validation figures come every eval_interval steps: markers
            ax.plot(steps, values, marker="." if len(values) < 50 else None, linewidth=1.2, label=key)
        ax.set_title("acceptance length: training metrics vs estimates of served tau")
        ax.set_xlabel("step")
        ax.set_ylabel("accepted tokens per block")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "acceptance.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def summarize(records: list[dict[str, Any]]) -> str:
    """First / last / best of each metric, the step range and throughput, as text."""
    first_step, last_step = records[0]["step"], records[-1]["step"]
    lines = [f"steps: {first_step} .. {last_step} ({len(records)} records)"]
    for key, (_, better) in METRICS.items():
        steps, values = _series(records, key)
        if not values:
            continue
        line = f"{key:<20} first {values[0]:.4g} (step {steps[0]:g})  last {values[-1]:.4g} (step {steps[-1]:g})"
        if better:
            i = values.index(min(values) if better == "min" else max(values))
            line += f"  best {values[i]:.4g} (step {steps[i]:g})"
        else:
            line += f"  mean {sum(values) / len(values):.4g}  max {max(values):.4g}"
        if key in ACCEPTANCE and len(values) > LAST_K:  # one record is one window of a few steps: read the trend
            line += f"  mean of last {LAST_K} {sum(values[-LAST_K:]) / LAST_K:.4g}"
        lines.append(line)
    if any(_series(records, key)[1] for key in ACCEPTANCE[1:]):
        lines.append(ACCEPTANCE_NOTE)
    _, tps = _series(records, "tok_per_sec")
    if tps:
        lines.append(f"tokens/s: mean {sum(tps) / len(tps):,.0f}, last {tps[-1]:,.0f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the report flags."""
    parser.add_argument("--run", required=True, help="run output folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="folder for the PNGs and summary.txt (default: RUN/plots)")


def run(args: argparse.Namespace) -> int:
    """CLI entry: plot, summarize, print the list of files."""
    run_dir = Path(args.run)
    records, skipped = read_metrics(run_dir / "metrics.jsonl")
    out = Path(args.out) if args.out else run_dir / "plots"
    pngs = plot_metrics(records, out)
    if not pngs:
        raise DFlashError(f"{run_dir / 'metrics.jsonl'}: none of the metrics {', '.join(METRICS)} is present")
    text = summarize(records)
    if skipped:
        text += f"\nskipped {skipped} unreadable line(s) of metrics.jsonl"
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    for p in [*pngs, out / "summary.txt"]:
        print(f"report: wrote {p}")
    return 0
