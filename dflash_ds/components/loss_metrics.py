"""The DFlash loss's metrics: additive sums of a batch (all-reduced across drafters before dividing) and the
record's figures from them (docs/DESIGN.md §3). LossTerms comes from components/loss.py."""

from __future__ import annotations

import math
from typing import Any

import torch

LossTerms = Any  # components/loss.LossTerms (importing it here would make an import cycle)


def leading_run(hits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block: number of leading positions that are valid and hit (stops at the first miss)."""
    return (hits & valid).long().cumprod(dim=-1).sum(dim=-1)


def metric_sums(terms: LossTerms) -> dict[str, torch.Tensor]:
    """Additive statistics (sums and counts) so ranks can all-reduce before dividing."""
    blocks = terms.valid[:, 0]
    k = terms.valid.shape[1]
    return {
        "valid_positions": terms.valid.sum().float(),
        "correct": terms.correct.sum().float(),
        "top4": terms.in_top4.sum().float(),
        "top8": terms.in_top8.sum().float(),
        "blocks": blocks.sum().float(),
        # Multiplied by the block mask, not indexed with it: boolean indexing syncs with the host.
        "streak": (leading_run(terms.correct, terms.valid) * blocks).sum().float(),
        "tree_streak4": (leading_run(terms.in_top4, terms.valid) * blocks).sum().float(),
        "tree_streak8": (leading_run(terms.in_top8, terms.valid) * blocks).sum().float(),
        "pos_correct": terms.correct.sum(0).float() if k else terms.correct.new_zeros(0).float(),
        "pos_valid": terms.valid.sum(0).float() if k else terms.valid.new_zeros(0).float(),
    }


# What acceptance_sums returns (runtime/step_metrics sums them over a record's window).
ACCEPTANCE_SUMS = ("alpha", "alpha_positions", "alpha_streak", "argmax_alpha", "argmax_alpha_streak")


def acceptance_sums(terms: LossTerms) -> dict[str, torch.Tensor]:
    """Sum of the acceptance estimate alpha over valid positions, and their count (0, 0 without the target's
    distributions): alpha = sum_v min(p_drafter, p_target), the chance that speculative sampling accepts
    a draft sampled from the drafter at T = loss.kl_temperature. And alpha's expected streak summed over
    blocks: sum_k prod_{j<=k} alpha_j, the expected number of a block's drafts speculative sampling accepts
    (alpha is 0 at an invalid position, which ends the product). The same two for the drafter's argmax
    drafted (argmax_alpha = p_target(argmax p_drafter): how vLLM and SGLang draft by default). Device
    tensors, no host read."""
    if terms.alpha is None:
        zero = terms.valid.new_zeros((), dtype=torch.float32)
        return {key: zero.clone() for key in ACCEPTANCE_SUMS}
    blocks = terms.valid[:, 0]
    out = {"alpha_positions": terms.valid.sum().float()}
    for name, rate in (("alpha", terms.alpha), ("argmax_alpha", terms.argmax_alpha)):
        out[name] = rate.sum().float()
        out[f"{name}_streak"] = (rate.float().cumprod(dim=-1).sum(dim=-1) * blocks).sum()
    return out


def metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """accuracy, per-position accuracy, mean streak, tau = 1 + streak, top-k, tree streaks; alpha and alpha_tau
    (1 + alpha's expected streak: tau's form for speculative sampling) when summed."""
    def ratio(a: str, b: str) -> float:
        den = float(sums[b])
        return float(sums[a]) / den if den > 0 else math.nan

    streak = ratio("streak", "blocks")
    pos_valid = sums["pos_valid"]
    pos_acc = [float(c) / float(n) if float(n) > 0 else math.nan for c, n in zip(sums["pos_correct"], pos_valid)]
    return {
        "accuracy": ratio("correct", "valid_positions"),
        "top4_accuracy": ratio("top4", "valid_positions"),
        "top8_accuracy": ratio("top8", "valid_positions"),
        "avg_streak": streak,
        "tau": 1.0 + streak,
        "tree_streak4": ratio("tree_streak4", "blocks"),
        "tree_streak8": ratio("tree_streak8", "blocks"),
        "accuracy_per_position": pos_acc,
        # tv_distance = 1 - alpha = 0.5 ||p_d - p_t||_1: the L1 term (lk l1, DSpark's) halved
        **({"alpha": ratio("alpha", "alpha_positions"), "tv_distance": 1.0 - ratio("alpha", "alpha_positions"),
            "alpha_tau": 1.0 + ratio("alpha_streak", "blocks"),
            "argmax_alpha": ratio("argmax_alpha", "alpha_positions"),
            "argmax_alpha_tau": 1.0 + ratio("argmax_alpha_streak", "blocks")}
           if float(sums.get("alpha_positions", 0.0)) > 0 else {}),
    }
