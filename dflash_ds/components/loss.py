"""Anchor sampling, block labels, the DFlash loss and its metrics (docs/DESIGN.md §3).

Shapes: N blocks (batch x anchors flattened), K = block_size - 1 predicted positions
per block, V vocabulary. Position k (1-based) of a block predicts x_{anchor+k}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator, max_total: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded choice of up to `num_anchors` anchor positions per sequence, at most `max_total` in all.

    Candidates are response tokens (loss_mask == 1) at positions a >= 1 with a whole block after
    them (a + block_size <= length). Every position gets a random key (one draw for the batch, on
    its device) and a row keeps its `quota` candidates of lowest key: quota = its candidate count
    capped at `num_anchors` and then, if `max_total` > 0, shared under the cap by `water_fill`. So a
    capped row keeps a subset of its uncapped picks, and a cap that does not bind changes nothing.
    Returns anchors [B, A] (sorted, padding = 0) and valid [B, A], A = the largest quota.

    Host reads: one. Everything is tensor ops on the batch's device, vectorised over rows, except
    reading A (a `.item()`) to size the output. A shape-only A would need no read, but water-filling
    may hand one row the whole cap, so it must be min(num_anchors, S - block_size, max_total): at the
    Qwen3-8B defaults (8 rows of 2,048, 512 per row, cap 2,048, block 16) 8 x 512 = 4,096 blocks
    every batch where 2,048 are kept, twice the drafter's layers, LM head and loss (they run on
    every block, padded or not), and 7.75x on a bucket of 32 rows of 512 (32 x 496 for 2,048).
    Read, A is 256 there whenever every row has 256 candidates (2,048 blocks, none padded); its
    worst case is that same 4,096, only when one row holds 512 candidates and the rest few.

    `generator` should live on loss_mask's device; one elsewhere (the trainer's CPU generator)
    lends its seed to a fresh one there. The same seed gives the same anchors on the same kind of
    device (CPU and CUDA draw different streams).
    """
    b, s = loss_mask.shape
    dev = loss_mask.device
    pos = torch.arange(s, device=dev)
    cand = (loss_mask > 0) & (pos >= 1) & (pos + block_size <= lengths[:, None])
    quotas = cand.sum(1).clamp(max=num_anchors)
    if max_total > 0:
        quotas = water_fill(quotas, max_total)
    keys = torch.rand((b, s), generator=_generator_on(generator, dev), device=dev, dtype=torch.float64)
    order = keys.masked_fill(~cand, 2.0).argsort(dim=1, stable=True)  # candidates first, in random order
    keep = pos < quotas[:, None]  # the first `quota` of each row's order
    picked = torch.where(keep, order, s).sort(dim=1).values  # kept positions ascending, then s
    a = max(1, int(quotas.max().item()))  # the one host read: the output's width
    anchors = picked[:, :a]
    valid = anchors < s
    return anchors.masked_fill(~valid, 0), valid


def _generator_on(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """`generator` if it draws on `device`, else a fresh generator there with its seed."""
    if generator.device == device:
        return generator
    return torch.Generator(device=device).manual_seed(generator.initial_seed())


def water_fill(counts: torch.Tensor, max_total: int) -> torch.Tensor:
    """Quotas [B] under a cap: the largest level q with sum(min(c, q)) <= max_total, the rest one each in row order.

    Every row keeps min(count, q) or one more; no row gives up anchors while a smaller row is cut,
    and the quotas sum to min(sum(counts), max_total). Tensor ops only (no host read): with the
    counts sorted, c_1 <= ... <= c_B and P_k = c_1 + ... + c_k, sum_i min(c_i, q) = min over k of
    (P_k + (B - k) q), so the level is the largest of floor((max_total - P_k) / (B - k)), k < B
    (at least max(counts) when the cap does not bind: then every quota is its count).
    """
    b = counts.numel()
    ascending = counts.sort().values
    below = ascending.cumsum(0) - ascending  # P_k, k = 0..B-1
    level = torch.div(max_total - below, torch.arange(b, 0, -1, device=counts.device), rounding_mode="floor").max()
    quotas = torch.minimum(counts, level)
    cut = counts > quotas
    spare = max_total - quotas.sum()  # fewer than the rows cut, or level + 1 would fit
    return quotas + (cut & (cut.cumsum(0) <= spare)).to(quotas.dtype)


def anchor_quotas(counts: list[int], max_total: int) -> list[int]:
    """`water_fill` of host counts, as a list (the memory model's A)."""
    if not counts:
        return []
    return water_fill(torch.tensor(counts, dtype=torch.long), max_total).tolist()


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


@dataclass
class LossSpec:
    """The loss knobs of `dflash_loss` (LossConfig's loss fields, without the sampling ones)."""

    gamma: float
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    streak_weight: float = 0.0


def _loss_parts(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: LossSpec,
                target_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Unnormalised DFlash loss of some blocks: (sum of weight * term, sum of weight, (correct, top4, top8)).

    Every block's weights depend on that block alone, so blocks can be split into chunks and the
    parts summed: the loss is the sum of the numerators over the sum of the weights.
    """
    n, k, v = logits.shape
    logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    safe_labels = labels.clamp(min=0, max=v - 1)
    label_logp = torch.gather(logp, -1, safe_labels[..., None]).squeeze(-1)
    term = -label_logp
    if target_logits is not None and spec.kl_weight > 0:
        t = spec.kl_temperature
        log_pd = F.log_softmax(logits / t, dim=-1)
        log_pt = F.log_softmax(target_logits.float() / t, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_pd)).sum(-1) * (t * t)
        term = (1.0 - spec.kl_weight) * term + spec.kl_weight * kl
    weight = decay_weights(k, spec.gamma, logits.device).expand(n, k)
    if spec.streak_weight > 0:
        weight = (1.0 - spec.streak_weight) * weight + spec.streak_weight * streak_weights(label_logp.exp(), valid)
    weight = weight * valid
    with torch.no_grad():
        top8 = logits.topk(min(8, v), dim=-1).indices
        hit = top8 == safe_labels[..., None]
        stats = (hit[..., 0] & valid, hit[..., :4].any(-1) & valid, hit.any(-1) & valid)
    return (weight * term).sum(), weight.sum().detach(), stats


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

    This holds every [N, K, V] intermediate at once; `chunked_dflash_loss` computes the same
    value and gradient from hidden states with O(chunk x V) memory.
    """
    spec = LossSpec(gamma, kl_weight, kl_temperature, streak_weight)
    num, weight_sum, (correct, in_top4, in_top8) = _loss_parts(logits, labels, valid, spec, target_logits)
    return LossTerms(num / weight_sum.clamp(min=1e-12), correct, in_top4, in_top8, valid, weight_sum)


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: LossSpec,
                         target_logits: torch.Tensor | None, need_grad: bool):
    """`_loss_parts` of one chunk plus d(numerator)/d(logits), by hand, with few [c, K, V] buffers.

    With p = softmax(z), p_d = softmax(z/T), p_t = softmax(t/T) and the (detached) weights w:
        d/dz [w ((1-a) CE + a T^2 KL)] = w ((1-a) (p - onehot(label)) + a T (p_d - p_t)).
    Every buffer is reused in place: about 8 bytes per (position x vocabulary entry) with hard
    labels and 16 with KL in fp32, against 12.4 / 32.5 for the autograd graph of `_loss_parts`.
    """
    n, k, v = logits.shape
    z = logits.float()
    y = labels.clamp(min=0, max=v - 1)[..., None]
    with torch.no_grad():
        top8 = z.topk(min(8, v), dim=-1).indices
        hit = top8 == y
        stats = (hit[..., 0] & valid, hit[..., :4].any(-1) & valid, hit.any(-1) & valid)
        del top8, hit
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        label_logp = (z.gather(-1, y) - lse).squeeze(-1)
        term = -label_logp
        alpha = spec.kl_weight if target_logits is not None else 0.0
        log_pd = log_pt = None
        if alpha > 0:
            t = spec.kl_temperature
            log_pt = target_logits.float() / t
            log_pt -= torch.logsumexp(log_pt, dim=-1, keepdim=True)
            log_pd = z / t
            log_pd -= torch.logsumexp(log_pd, dim=-1, keepdim=True)
            p_t = log_pt.exp()
            log_pt -= log_pd  # log_pt now holds log(p_t / p_d)
            kl = (log_pt.mul_(p_t)).sum(-1) * (t * t)
            term = (1.0 - alpha) * term + alpha * kl
        weight = decay_weights(k, spec.gamma, z.device).expand(n, k)
        if spec.streak_weight > 0:
            weight = (1.0 - spec.streak_weight) * weight + spec.streak_weight * streak_weights(label_logp.exp(), valid)
        weight = weight * valid
        num = (weight * term).sum()
        dz = None
        if need_grad:
            dz = z.sub_(lse).exp_()  # p, in z's buffer (the head's backward does not read its output)
            dz.mul_(((1.0 - alpha) * weight)[..., None])
            dz.scatter_add_(-1, y, -((1.0 - alpha) * weight)[..., None])
            if alpha > 0:
                p_d = log_pd.exp_()
                dz.add_(p_d.sub_(p_t).mul_((alpha * spec.kl_temperature * weight)[..., None]))
    return num, weight.sum(), stats, dz


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum over chunks of blocks of the unnormalised loss of `head(hidden)`, never holding all logits.

    The forward pass computes each chunk's logits, loss numerator and the numerator's gradient
    with respect to the logits (`_chunk_loss_and_grad`), carries it back through the head to
    that chunk's hidden states, then frees the chunk: peak memory is one chunk's [c, K, V]
    buffers. Backward only scales the stored [N, K, H] gradient. The head is frozen.
    """

    @staticmethod
    def forward(ctx, hidden, labels, valid, target_hidden, head, spec, chunk, need_grad):  # noqa: D401
        n = hidden.shape[0]
        grad = torch.zeros_like(hidden) if need_grad else None
        num = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weight_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        stats: list[list[torch.Tensor]] = [[], [], []]
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            with torch.enable_grad():
                h = hidden[lo:hi].detach().requires_grad_(need_grad)
                logits = head(h)
            target_logits = head(target_hidden[lo:hi]) if target_hidden is not None else None
            part, w, st, dz = _chunk_loss_and_grad(logits, labels[lo:hi], valid[lo:hi], spec, target_logits,
                                                   need_grad)
            del target_logits
            if need_grad:
                grad[lo:hi] = torch.autograd.grad(logits, h, dz.to(logits.dtype))[0]
            num += part
            weight_sum += w
            for acc, t in zip(stats, st):
                acc.append(t)
            del h, logits, dz
        ctx.save_for_backward(grad)
        outs = (weight_sum, *(torch.cat(acc) for acc in stats))
        ctx.mark_non_differentiable(*outs)
        return (num, *outs)

    @staticmethod
    def backward(ctx, g_num, *_):
        (grad,) = ctx.saved_tensors
        return (grad * g_num.to(grad.dtype) if grad is not None else None), None, None, None, None, None, None, None


def chunked_dflash_loss(hidden: torch.Tensor, head, labels: torch.Tensor, valid: torch.Tensor, *, gamma: float,
                        target_hidden: torch.Tensor | None = None, kl_weight: float = 0.0,
                        kl_temperature: float = 1.0, streak_weight: float = 0.0,
                        chunk_blocks: int = 64) -> LossTerms:
    """`dflash_loss(head(hidden), ...)` computed `chunk_blocks` blocks at a time (same value and gradient).

    hidden [N, K, H]: the drafter's final-normed states of the predicted positions; head maps
    [..., H] to vocabulary logits (the target's frozen LM head). target_hidden [N, K, H]: the
    target's final hidden state at the same positions, for the KL term (its logits are
    computed chunk by chunk too). Peak memory is O(chunk_blocks x K x V) instead of O(N x K x V):
    about 8 bytes per (label position x vocabulary entry) of a chunk for CE, 16 with KL (fp32
    buffers; plus the head's own output in the run dtype).
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    spec = LossSpec(gamma, kl_weight if target_hidden is not None else 0.0, kl_temperature, streak_weight)
    th = target_hidden if spec.kl_weight > 0 else None
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    num, weight_sum, correct, in_top4, in_top8 = _ChunkedHeadLoss.apply(
        hidden, labels, valid, th, head, spec, chunk_blocks, need_grad)
    return LossTerms(num / weight_sum.clamp(min=1e-12), correct, in_top4, in_top8, valid, weight_sum)


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
