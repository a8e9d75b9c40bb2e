"""The recipe table of `dflash-ds bench recipe` (bench/recipe.py): each recipe's runs summarized over seeds, the
text table and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


# The last training record's figures a row averages over seeds (where every seed's run logged them).
TRAIN_FIGURES = ("train_tau", "train_est_tau", "train_alpha_tau", "train_argmax_alpha_tau")


def summarize(recipes: list[dict], results: list[dict]) -> list[dict[str, Any]]:
    """Per recipe: mean and spread over seeds, and the difference to the first recipe (the baseline)."""
    rows = []
    for r in recipes:
        mine = [x for x in results if x["recipe"] == r["name"]]
        taus, pooled = [x["tau"] for x in mine], [x["tau_pooled"] for x in mine]
        positions = len(mine[0]["per_position_acceptance"])
        rows.append({"recipe": r["name"], "overrides": r["set"], "seeds": [x["seed"] for x in mine],
                     "tau_mean": statistics.fmean(taus), "tau_std": _spread(taus), "tau_min": min(taus),
                     "tau_max": max(taus), "tau_pooled_mean": statistics.fmean(pooled),
                     "tau_pooled_std": _spread(pooled),
                     "per_position_acceptance": [statistics.fmean(x["per_position_acceptance"][k] for x in mine)
                                                 for k in range(positions)],
                     "train_tokens": statistics.fmean(x["train_tokens"] for x in mine),
                     "train_wall_s": statistics.fmean(x["train_wall_s"] for x in mine),
                     **({"train_cpu_s": statistics.fmean(x["train_cpu_s"] for x in mine)}
                        if all("train_cpu_s" in x for x in mine) else {}),
                     **{key: statistics.fmean(x[key] for x in mine) for key in TRAIN_FIGURES
                        if all(key in x for x in mine)}})
    base = rows[0]
    for row in rows:
        row["vs_baseline"] = row["tau_mean"] - base["tau_mean"]
        # Beyond the seed spread: the two recipes' ranges over seeds do not overlap.
        row["beyond_spread"] = row is not base and (row["tau_min"] > base["tau_max"] or row["tau_max"] < base["tau_min"])
    return rows


def format_table(rows: list[dict], baseline: str, temperature: float = 0.0, draft_sample: str = "greedy") -> str:
    """The recipe table, one line per recipe."""
    # The training figure that predicts this serving: the greedy walk, or alpha's expected streak for sampling.
    name = "est_tau" if temperature <= 0 else "argmax_alpha_tau" if draft_sample == "greedy" else "alpha_tau"
    predictor = f"train_{name}"
    lines = [f"{'recipe':<16} {'tau':>13} {'pooled':>13} {'vs ' + baseline:>12} {'tokens':>9} {'wall s':>7} {'cpu s':>7} "
             f"{'train tau':>9} {name:>9}  P(position k accepted)"]
    for r in rows:
        mark = " *" if r["beyond_spread"] else ""
        lines.append(f"{r['recipe']:<16} {r['tau_mean']:>6.3f} ±{r['tau_std']:<5.3f} "
                     f"{r['tau_pooled_mean']:>6.3f} ±{r['tau_pooled_std']:<5.3f} {r['vs_baseline']:>+10.3f}{mark:<2} "
                     f"{r['train_tokens']:>9.0f} {r['train_wall_s']:>7.0f} {_figure(r, 'train_cpu_s', '.0f'):>7} "
                     f"{_figure(r, 'train_tau'):>9} "
                     f"{_figure(r, predictor):>9}  "
                     + " ".join(f"{p:.2f}" for p in r["per_position_acceptance"]))
    served, estimate = (("greedy (lossless-checked)", "greedy-walk estimate") if temperature <= 0 else
                        (f"speculative sampling at temperature {temperature:g} ({draft_sample} drafts)",
                         f"expected accepted length under {draft_sample} drafts, where the loss read the target's "
                         "distribution"))
    lines.append(f"tau: held-out, {served}, mean over prompts of each prompt's mean accepted length; ± the standard "
                 f"deviation over seeds; * = seed ranges do not overlap with {baseline}'s; train tau / {name}: the "
                 f"last training record's uniform argmax tau and {estimate} (mean over seeds); wall s / cpu s: "
                 f"training seconds, wall and CPU (user + system of every rank: with 1 thread a rank, what an idle "
                 f"core takes, whatever else ran)")
    return "\n".join(lines)


def _figure(row: dict, key: str, spec: str = ".2f") -> str:
    return format(row[key], spec) if key in row else "-"


def plot(rows: list[dict], results: list[dict], path: Path, temperature: float = 0.0) -> None:
    """tau per recipe: the mean with its spread, and every seed's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows)), 3.5))
    xs = range(len(rows))
    ax.bar(xs, [r["tau_mean"] for r in rows], yerr=[r["tau_std"] for r in rows], color="#8fb3d9", capsize=4)
    for i, r in enumerate(rows):
        seeds = [x["tau"] for x in results if x["recipe"] == r["recipe"]]
        ax.plot([i] * len(seeds), seeds, "k.", ms=5)
    ax.set_xticks(list(xs), [r["recipe"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("held-out tau" if temperature <= 0 else f"held-out tau, sampled at T={temperature:g}")
    ax.set_ylim(bottom=1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
