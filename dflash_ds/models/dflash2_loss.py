"""The DFlash2 loss module (models/kinds.py `KindSpec.loss_module`): the selector term, K-way cross-entropy over a
position's candidates given the gold predecessor.

What peers train (no official recipe; read in NVIDIA NeMo AutoModel's DFlash2 trainer description and the
issue): at drafted position l of a block, the candidates are the target head's top-K tokens of the
drafter's hidden state h_l; the score of candidate c is the engines' (models/dflash2_selector.py)
with the gold predecessor p_l (the anchor at l = 0, else the gold token of position l - 1):

    s(c) = unary(c) + <predecessor_codebook[p_l] * hidden_projection(h_l), successor_codebook[c]>

and the loss is CE(s, index of the gold token), weighted by the DFlash position weights
exp(-(l)/gamma). When the top-K misses the gold token (`gold`, loss.selector_gold): `swap` puts it in the
K-th (weakest) slot with its own unary score, so every valid position carries a signal (speculators' rule);
`drop` gives those positions no selector term (NeMo's; the walk can never draft the gold there, so the term
would push the backbone, through hidden_projection, toward cases it cannot serve).

Choices, and why:
- The unary scores are detached here: the DFlash CE over the vocabulary already trains the head's
  logits, and keeping them out of this graph keeps the term's memory at O(chunk x K x rank) instead of
  another O(chunk x vocabulary) saved for backward (vocabulary logits are computed without grad, chunk
  by chunk, only to choose the candidates).
- The pair term's gradient reaches the backbone through hidden_projection(h) unless `detach` (then the
  selector trains on the backbone's states as they are: loss.selector_detach).

Statistics (additive, for all-reduce): `selector_correct` (argmax of s is gold, given gold predecessor:
what the walk picks where everything before was right), `unary_correct_k` (argmax of the unary scores
alone is gold), `candidate_hits` (gold inside the top-K), over `selector_positions` valid positions; logged as
selector_accuracy, unary_accuracy_k, candidate_recall and selector_loss (`metrics`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_ds.models.dflash2_selector import soft_cap
from dflash_ds.models.kinds import DraftedPositions, KindTerms

SUMS = ("selector_loss_sum", "selector_weight_sum", "selector_correct", "unary_correct_k", "candidate_hits",
        "selector_positions")


def loss_terms(drafter, at: DraftedPositions, loss) -> KindTerms:
    """loss.selector_weight x the selector term (none at weight 0). Its candidates are the DFlash loss's top-K
    (`top_k`): the LM head runs once per step."""
    if not loss.selector_weight > 0:
        return KindTerms()
    o = drafter.arch.options

    def finish(terms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        term, sums = selector_loss(
            at.hidden, at.lm_head, drafter.candidate_selector, at.labels, at.valid, at.anchor_ids,
            top_k=o.selector_top_k, output_multiplier=o.output_multiplier, softcap=o.final_logit_softcapping,
            gamma=loss.gamma, detach=loss.selector_detach, gold_rule=loss.selector_gold,
            chunk_blocks=loss.chunk_blocks, candidates=terms.candidates)
        return loss.selector_weight * term, sums

    return KindTerms({"top_k": o.selector_top_k}, finish)


def candidates_with_gold(logits: torch.Tensor, labels: torch.Tensor, top_k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-K ids and logits of [..., V] logits with the gold label put in the K-th slot where it is missing.

    Returns ids [..., K], their logits [..., K], the gold's index [...] and whether top-K held it [...].
    """
    values, ids = logits.topk(top_k, dim=-1)
    return gold_into_top_k(ids, values, logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1), labels)


def gold_into_top_k(ids: torch.Tensor, values: torch.Tensor, gold_logit: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`candidates_with_gold` from a top-K already taken (ids / values [..., K]) and the gold's logit [...]."""
    top_k = ids.shape[-1]
    hit = ids == labels.unsqueeze(-1)
    found = hit.any(-1)
    last = torch.full_like(labels, top_k - 1)
    ids = torch.cat([ids[..., :-1], torch.where(found, ids[..., -1], labels).unsqueeze(-1)], dim=-1)
    values = torch.cat([values[..., :-1], torch.where(found, values[..., -1], gold_logit).unsqueeze(-1)], dim=-1)
    return ids, values, torch.where(found, hit.float().argmax(-1), last), found


def selector_loss(hidden: torch.Tensor, head, selector, labels: torch.Tensor, valid: torch.Tensor,
                  anchor_ids: torch.Tensor, *, top_k: int, output_multiplier: float = 1.0, softcap: float = 0.0,
                  gamma: float = 7.0, detach: bool = False, gold_rule: str = "swap", chunk_blocks: int = 64,
                  candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted mean selector CE over valid positions, and its additive statistics (SUMS).

    hidden [N, L, H]: the drafter's final-normed states of the drafted positions; head: the target's LM
    head; selector: a models/dflash2_selector.CandidateSelector; labels / valid [N, L]; anchor_ids [N].
    `gold_rule` swap / drop: see the module's docstring. `candidates` (ids [N, L, K], logits [N, L, K], the label's logit [N, L]: `LossTerms.candidates` of the
    DFlash loss's chunks) are the head's top-K already taken: the head does not run again. Without them,
    vocabulary logits exist for `chunk_blocks` blocks at a time, without grad.
    """
    n, length, _ = hidden.shape
    weights = torch.exp(-torch.arange(length, device=hidden.device, dtype=torch.float32) / gamma)
    prev = torch.cat([anchor_ids.view(n, 1), labels[:, :-1]], dim=1)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    h_sel = hidden.detach() if detach else hidden
    with torch.no_grad():
        if candidates is not None:
            ids, values, gold, found = gold_into_top_k(*candidates, safe_labels)
        else:
            ids, values, gold, found = _head_candidates(hidden, head, safe_labels, top_k, chunk_blocks)
        unary = soft_cap(values * output_multiplier, softcap)
    # One pass over every position: what it keeps for backward is K x rank values a position (30,720 x 8 x 64 x 2 B
    # = 31 MB at the Qwen3-8B preset's micro-step); by chunks it was ~20 small kernels each and a [V, rank] zero and
    # sum of each codebook's gradient per chunk (32 of them a micro-step). tables: one module call (ZeRO-3).
    pairs = selector.pair_scores(h_sel, prev.unsqueeze(-1), ids, selector()).squeeze(-2)
    scores = unary + pairs
    ce = F.cross_entropy(scores.flatten(0, 1), gold.flatten(), reduction="none").view(n, length)
    kept = valid & found if gold_rule == "drop" else valid
    w = weights * kept.float()
    with torch.no_grad():
        stats = {"selector_loss_sum": (ce.detach() * w).sum(), "selector_weight_sum": w.sum(),
                 "selector_correct": ((scores.argmax(-1) == gold) & valid).sum().float(),
                 "unary_correct_k": ((unary.argmax(-1) == gold) & found & valid).sum().float(),
                 "candidate_hits": (found & valid).sum().float(), "selector_positions": valid.sum().float()}
    return (ce * w).sum() / stats["selector_weight_sum"].clamp(min=1e-12), stats


def _head_candidates(hidden: torch.Tensor, head, labels: torch.Tensor, top_k: int, chunk_blocks: int
                     ) -> tuple[torch.Tensor, ...]:
    """`candidates_with_gold` of the head's logits, `chunk_blocks` blocks at a time (the vocabulary logits are the
    large part: chunk x L x V), concatenated."""
    n, length, _ = hidden.shape
    parts = []
    for lo in range(0, n, chunk_blocks):
        hi = min(n, lo + chunk_blocks)
        # one [c*L, H] GEMM, not a batched one over a strided view (components/loss.py says why)
        logits = head(hidden[lo:hi].detach().reshape((hi - lo) * length, -1)).view(hi - lo, length, -1).float()
        parts.append(candidates_with_gold(logits, labels[lo:hi], top_k))
        del logits
    return tuple(torch.cat(p) for p in zip(*parts))


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """selector_accuracy (given the gold predecessor), unary_accuracy_k (the same positions, unary argmax),
    candidate_recall (the top-K holds the gold token), selector_loss; {} without a selector position."""
    if not float(sums.get("selector_positions", 0.0)) > 0:
        return {}

    def ratio(a: str, b: str) -> float:
        den = float(sums.get(b, 0.0))
        return float(sums.get(a, 0.0)) / den if den > 0 else math.nan

    return {"selector_accuracy": ratio("selector_correct", "selector_positions"),
            "unary_accuracy_k": ratio("unary_correct_k", "selector_positions"),
            "candidate_recall": ratio("candidate_hits", "selector_positions"),
            "selector_loss": ratio("selector_loss_sum", "selector_weight_sum")}
