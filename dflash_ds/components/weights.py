"""Per-position weights of the DFlash loss (docs/DESIGN.md §3): position decay, D-PACE, streak reach.

Shapes: N blocks, K = block_size - 1 predicted positions per block. Every weight of a block depends on
that block alone (its own label probabilities), so the chunked loss can weigh a chunk at a time.
"""

from __future__ import annotations

import torch


def decay_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..num_positions."""
    k = torch.arange(num_positions, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def streak_weights(label_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """s_k = prod_{i<k} p_i, p_i = drafter probability of the correct token at position i (detached).

    s_1 = 1. Invalid positions contribute p_i = 1 (they neither break nor extend a streak;
    their own weight is zeroed by the mask anyway). s_k estimates how likely the drafter's
    streak is to reach position k, so training concentrates where acceptance breaks.
    """
    p = torch.where(valid, label_prob.detach().float(), torch.ones_like(label_prob, dtype=torch.float32))
    ones = torch.ones_like(p[..., :1])
    return torch.cumprod(torch.cat([ones, p[..., :-1]], dim=-1), dim=-1)


def dpace_weights(label_prob: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights (arXiv 2605.18810, eqs. 7-8): d_k = sum_{m >= k, valid} prod_{i <= m} q~_i, detached.

    q~_i = (1 - alpha) * p_i + alpha smooths the drafter's probability p_i of the label at position i
    (alpha = 1: every q~ is 1 and d_k counts the valid positions from k on); an invalid position has
    q~ = 1 and adds no term. prod_{i<=m} q~_i estimates that the drafter's run reaches past position m,
    so d_k is position k's share of the expected accepted length: large for early positions while the
    drafter is unsure, flattening towards later ones as it gets them right. Unnormalised (d_1 is up to
    K); the loss divides by the sum of the weights as it does for the decay weights.
    """
    q = label_prob.detach().float()
    smooth = torch.where(valid, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    reach = torch.cumprod(smooth, dim=-1) * valid
    return reach.flip(-1).cumsum(-1).flip(-1)


def position_weights(label_prob: torch.Tensor, valid: torch.Tensor, *, gamma: float, position_weighting: str,
                     dpace_alpha: float, streak_weight: float) -> torch.Tensor:
    """Weights [N, K] before the mask: (1 - lambda) * base + lambda * streak, base = decay or D-PACE.

    label_prob [N, K]: the drafter's probability of each position's label (detached here).
    """
    n, k = label_prob.shape
    if position_weighting == "dpace":
        weight = dpace_weights(label_prob, valid, dpace_alpha)
    else:
        weight = decay_weights(k, gamma, label_prob.device).expand(n, k)
    if streak_weight > 0:
        weight = (1.0 - streak_weight) * weight + streak_weight * streak_weights(label_prob, valid)
    return weight
