"""Anchor sampling, block labels, the DFlash loss and its metrics (DESIGN §3).

Shapes: N blocks (batch x anchors flattened), K = block_size - 1 predicted positions
per block, V vocabulary. Position k (1-based) of a block predicts x_{anchor+k}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded choice of up to `num_anchors` anchor positions per sequence.

    Candidates are response tokens (loss_mask == 1) at positions a >= 1 with a whole block
    after them (a + block_size <= length). Returns anchors [B, A] (sorted, padding = 0) and
    valid [B, A], A = the largest number chosen in any row.
    """
    b, s = loss_mask.shape
    pos = torch.arange(s)
    cand = (loss_mask.cpu() > 0) & (pos[None, :] >= 1) & (pos[None, :] + block_size <= lengths.cpu()[:, None])
    chosen: list[torch.Tensor] = []
    for row in range(b):
        idx = cand[row].nonzero().flatten()
        if idx.numel() > num_anchors:
            pick = torch.randperm(idx.numel(), generator=generator)[:num_anchors]
            idx = idx[pick].sort().values
        chosen.append(idx)
    a = max(1, max(c.numel() for c in chosen))
    anchors = torch.zeros(b, a, dtype=torch.long)
    valid = torch.zeros(b, a, dtype=torch.bool)
    for row, idx in enumerate(chosen):
        anchors[row, : idx.numel()] = idx
        valid[row, : idx.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_inputs_and_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                            anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                            mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens [B, A, bs] = [x_a, MASK...], labels [B, A, bs-1] = x_{a+1..a+bs-1}, label_valid."""
    b, s = input_ids.shape
    offs = torch.arange(1, block_size, device=input_ids.device)
    pos = anchors[:, :, None] + offs  # [B, A, K]
    in_seq = pos < lengths[:, None, None]
    pos_c = pos.clamp(max=s - 1)
    flat = pos_c.reshape(b, -1)
    labels = torch.gather(input_ids, 1, flat).view_as(pos)
    on = torch.gather(loss_mask, 1, flat).view_as(pos) > 0
    label_valid = in_seq & on & valid[:, :, None]
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    blocks[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return blocks, labels, label_valid


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


@dataclass
class LossTerms:
    """The scalar loss and the per-block statistics that metrics are built from."""

    loss: torch.Tensor
    correct: torch.Tensor  # [N, K] bool: argmax == label
    in_top4: torch.Tensor  # [N, K] bool
    in_top8: torch.Tensor  # [N, K] bool
    valid: torch.Tensor  # [N, K] bool
    weight_sum: torch.Tensor  # scalar: sum of weights over valid positions


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *, gamma: float,
                target_logits: torch.Tensor | None = None, kl_weight: float = 0.0, kl_temperature: float = 1.0,
                streak_weight: float = 0.0) -> LossTerms:
    """The DFlash objective over N blocks of K positions.

    Per position k (1-based) and block n:
        term  = (1 - alpha) * CE(logits, label) + alpha * T^2 * KL(softmax(t/T) || softmax(z/T))
        w_k   = exp(-(k-1)/gamma)                           position decay
        s_nk  = prod_{i<k} softmax(z_ni)[label_ni]          streak reach, detached
        weight_nk = (1 - lambda) * w_k + lambda * s_nk      lambda = streak_weight
        loss  = sum(valid * weight * term) / sum(valid * weight)
    alpha = kl_weight (0 when no target_logits), T = kl_temperature. A batch with no valid
    position gives loss 0 (with a graph, so lockstep backward still runs).
    """
    n, k, v = logits.shape
    logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    safe_labels = labels.clamp(min=0, max=v - 1)
    label_logp = torch.gather(logp, -1, safe_labels[..., None]).squeeze(-1)
    term = -label_logp
    if target_logits is not None and kl_weight > 0:
        t = kl_temperature
        log_pd = F.log_softmax(logits / t, dim=-1)
        log_pt = F.log_softmax(target_logits.float() / t, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_pd)).sum(-1) * (t * t)
        term = (1.0 - kl_weight) * term + kl_weight * kl
    weight = decay_weights(k, gamma, logits.device).expand(n, k)
    if streak_weight > 0:
        weight = (1.0 - streak_weight) * weight + streak_weight * streak_weights(label_logp.exp(), valid)
    weight = weight * valid
    weight_sum = weight.sum()
    loss = (weight * term).sum() / weight_sum.clamp(min=1e-12)
    with torch.no_grad():
        top8 = logits.topk(min(8, v), dim=-1).indices
        hit = top8 == safe_labels[..., None]
        correct = hit[..., 0] & valid
        in_top4 = hit[..., :4].any(-1) & valid
        in_top8 = hit.any(-1) & valid
    return LossTerms(loss, correct, in_top4, in_top8, valid, weight_sum.detach())


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
        "streak": leading_run(terms.correct, terms.valid)[blocks].sum().float(),
        "tree_streak4": leading_run(terms.in_top4, terms.valid)[blocks].sum().float(),
        "tree_streak8": leading_run(terms.in_top8, terms.valid)[blocks].sum().float(),
        "pos_correct": terms.correct.sum(0).float() if k else terms.correct.new_zeros(0).float(),
        "pos_valid": terms.valid.sum(0).float() if k else terms.valid.new_zeros(0).float(),
    }


def metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """accuracy, per-position accuracy, mean streak, tau = 1 + streak, top-k, tree streaks."""
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
    }
