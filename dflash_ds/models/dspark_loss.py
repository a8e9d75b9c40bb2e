"""The DSpark loss module (models/kinds.py `KindSpec.loss_module`): the Markov bias of the DFlash loss, teacher-forced,
and the confidence term and its calibration: BCE of the head's logit against the acceptance rate.

DeepSpec's rule (`deepspec/modeling/dspark/loss.py`): the target of position k is alpha_k = 1 - 0.5
||p_k - q_k||_1 = sum_v min(p, q), the chance that speculative sampling accepts a token drawn from the
drafter's q_k (Markov bias included, teacher-forced), detached; the BCE is weighted by the same position
decay as the rest of the loss. Without the target's distribution in the batch the target is the greedy hit
(argmax == label), what greedy decoding of the data accepts; `loss.confidence_target: greedy` asks for the hit
always (`loss_terms` passes no alpha then).

Calibration, logged per record (additive sums, for all-reduce), judged against the target the head trains for
(`eval` judges an export the same way, against real acceptance): the expected calibration error of sigmoid(logit)
over 10 equal-width bins (the mean target of a bin stands for its acceptance rate), the Brier score (p - target)^2
(eval/summary.py's `calibration` against alpha alike), and the mean |confidence - target| (DeepSpec's
confidence_abs_error).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_ds.components.weights import decay_weights
from dflash_ds.models.kinds import DraftedPositions, KindTerms

BINS = 10
SUMS = ("conf_loss_sum", "conf_weight_sum", "conf_positions", "conf_brier", "conf_abs_err",
                   *(f"conf_bin{b}_{k}" for b in range(BINS) for k in ("n", "p", "hit")))


def loss_terms(drafter, at: DraftedPositions, loss) -> KindTerms:
    """The Markov bias in the DFlash loss (position k reads the gold token before it: the anchor, then the labels)
    and loss.confidence_weight x the confidence term (none at weight 0 or without the head)."""
    n = at.hidden.shape[0]
    prev = torch.cat([at.anchor_ids.view(n, 1), at.labels[:, :-1].clamp(min=0)], dim=1)  # 0 where there is none
    markov = drafter.markov_head
    embed_prev = markov.embed(prev)
    # markov_w2 as [r, V] through the module's own forward (bias of the identity), never its .weight: under ZeRO-3
    # a parameter is whole only inside its module's forward, and its gradient must flow back through it
    eye = torch.eye(embed_prev.shape[-1], device=at.hidden.device, dtype=embed_prev.dtype)

    def finish(terms) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        conf = drafter.confidence_logits(at.hidden, embed_prev)
        if conf is None or not loss.confidence_weight > 0:
            return None, {}
        # sampled: DeepSpec's alpha (the greedy hit where the batch has no target distribution); greedy: the hit
        aim = terms.alpha if loss.confidence_target == "sampled" else None
        term, sums = confidence_loss(conf, aim, terms.correct, terms.valid,
                                     decay_weights(at.hidden.shape[1], loss.gamma, at.hidden.device))
        return loss.confidence_weight * term, sums

    return KindTerms({"logit_bias": (embed_prev, markov.bias(eye))}, finish)


def confidence_loss(logits: torch.Tensor, alpha: torch.Tensor | None, hit: torch.Tensor, valid: torch.Tensor,
                    weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted mean BCE over valid positions and the calibration sums (SUMS), both against the same target.

    logits / hit / valid [N, K]; alpha [N, K] or None (then the target is `hit`); weights [K] or [N, K]
    (the position decay).
    """
    target = (alpha if alpha is not None else hit.float()).detach().clamp(0.0, 1.0)
    w = weights.float() * valid.float()
    bce = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none")
    loss = (bce * w).sum() / w.sum().clamp(min=1e-12)
    with torch.no_grad():
        # h: the acceptance the head is judged against, the one it trains for (module doc)
        p, v, h = torch.sigmoid(logits.float()), valid.float(), target.float()
        sums = {"conf_loss_sum": (bce * w).sum(), "conf_weight_sum": w.sum(), "conf_positions": v.sum(),
                "conf_brier": (((p - h) ** 2) * v).sum(), "conf_abs_err": ((p - target).abs() * v).sum()}
        idx = (p * BINS).long().clamp(max=BINS - 1)
        for b in range(BINS):
            m = (idx == b).float() * v
            sums.update({f"conf_bin{b}_n": m.sum(), f"conf_bin{b}_p": (p * m).sum(), f"conf_bin{b}_hit": (h * m).sum()})
    return loss, sums


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """confidence_ece, confidence_brier, confidence_abs_error (each against the BCE's target: the teacher-forced
    greedy hit, or alpha) and confidence_loss, from summed SUMS; {} without a judged position."""
    n = float(sums.get("conf_positions", 0.0))
    if n <= 0:
        return {}
    ece = sum(abs(float(sums[f"conf_bin{b}_p"]) - float(sums[f"conf_bin{b}_hit"])) for b in range(BINS)) / n
    w = float(sums["conf_weight_sum"])
    return {"confidence_ece": ece, "confidence_brier": float(sums["conf_brier"]) / n,
            "confidence_abs_error": float(sums["conf_abs_err"]) / n,
            "confidence_loss": float(sums["conf_loss_sum"]) / w if w > 0 else math.nan}
