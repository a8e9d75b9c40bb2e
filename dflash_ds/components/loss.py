"""The DFlash loss and its metrics (docs/DESIGN.md §3): CE, KL and LK terms, chunked over blocks.

Shapes: N blocks (batch x anchors flattened), K = block_size - 1 predicted positions
per block, V vocabulary. Position k (1-based) of a block predicts x_{anchor+k}.
Anchor sampling and block labels live in components/anchors.py (re-exported here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ds.components.anchors import (  # noqa: F401  (re-exported: they lived here)
    anchor_quotas, block_inputs_and_labels, sample_anchors, water_fill)
from dflash_ds.components.fusion import compiles_for, fused
from dflash_ds.components.loss_metrics import (  # noqa: F401  (re-exported: they lived here)
    ACCEPTANCE_SUMS, acceptance_sums, leading_run, metric_sums, metrics_from_sums)
from dflash_ds.components.weights import decay_weights, position_weights, streak_weights  # noqa: F401
from dflash_ds.config import LossConfig

LK_EPS = 1e-8  # -log(alpha + eps): finite where alpha underflows; the gradient never switches off
LABELS, LK_KINDS, POSITION_WEIGHTINGS = ("data", "target"), ("", "log", "hybrid", "l1"), ("decay", "dpace")


@dataclass
class LossTerms:
    """The scalar loss and the per-block statistics that metrics are built from."""

    loss: torch.Tensor
    correct: torch.Tensor  # [N, K] bool: argmax == label
    in_top4: torch.Tensor  # [N, K] bool
    in_top8: torch.Tensor  # [N, K] bool
    valid: torch.Tensor  # [N, K] bool
    weight_sum: torch.Tensor  # scalar: sum of weights over valid positions
    alpha: torch.Tensor | None = None  # [N, K] float: sum_v min(p_d, p_t) where valid, else 0; None: no target
    # [N, K] float: p_t(argmax p_d) where valid, else 0 (None: no target): the chance that sampling at T accepts
    # the drafter's argmax, which is how vLLM and SGLang draft by default
    argmax_alpha: torch.Tensor | None = None
    # (ids [N, K, k], logits [N, K, k], the label's logit [N, K]) of the head's top-k, fp32, when asked for
    # (`chunked_dflash_loss(top_k=k)`: DFlash2's selector reads its candidates here, not from a second head pass)
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class LossSpec:
    """The loss knobs of `dflash_loss` (LossConfig's loss fields, without the sampling ones)."""

    gamma: float
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    streak_weight: float = 0.0
    labels: str = "data"
    lk: str = ""
    lk_weight: float = 1.0
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 1.0
    position_weighting: str = "decay"
    dpace_alpha: float = 0.5

    def __post_init__(self) -> None:
        for name, allowed in (("labels", LABELS), ("lk", LK_KINDS), ("position_weighting", POSITION_WEIGHTINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"loss {name} = {getattr(self, name)!r}: must be one of {allowed}")

    @property
    def needs_target(self) -> bool:
        """Whether a term reads the target's distribution (KL, LK, target labels)."""
        return self.kl_weight > 0 or self.lk != "" or self.labels == "target"

    def without_target(self) -> "LossSpec":
        """These knobs with every term that needs the target's distribution off (CE on the data labels)."""
        return dataclasses.replace(self, kl_weight=0.0, lk="", labels="data")


def loss_knobs(cfg: LossConfig) -> dict:
    """The `LossSpec` fields of a LossConfig, as keyword arguments of the loss functions."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(LossSpec)}


def lk_terms(spec: LossSpec, alpha: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LK loss per position and its partial derivatives: (value, d value / d alpha, d value / d KL).

    log:    -log(alpha + eps)
    hybrid: w * KL + (1 - w) * (1 - alpha),  w = lk_kl_scale * exp(-lk_kl_decay * alpha), alpha detached in w
    l1:     ||p_d - p_t||_1 = 2 (1 - alpha)  (DeepSpec's DSpark term)
    alpha = sum_v min(p_d, p_t) and KL = KL(p_t || p_d) at T = kl_temperature (no T^2 factor).
    """
    if spec.lk == "log":
        return -torch.log(alpha + LK_EPS), -1.0 / (alpha.detach() + LK_EPS), torch.zeros_like(kl)
    if spec.lk == "l1":
        return 2.0 * (1.0 - alpha), torch.full_like(alpha, -2.0), torch.zeros_like(kl)
    w = spec.lk_kl_scale * torch.exp(-spec.lk_kl_decay * alpha.detach())
    return w * kl + (1.0 - w) * (1.0 - alpha), -(1.0 - w), w


def _weights(label_prob: torch.Tensor, valid: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Masked position weights [N, K] of a chunk (components/weights.position_weights)."""
    return position_weights(label_prob, valid, gamma=spec.gamma, position_weighting=spec.position_weighting,
                            dpace_alpha=spec.dpace_alpha, streak_weight=spec.streak_weight) * valid


def _loss_parts(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: LossSpec,
                target_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Unnormalised DFlash loss of some blocks by autograd: (sum of weight * term, sum of weight, statistics).

    Statistics: (correct, top4, top8, alpha, argmax_alpha). Every block's weights depend on that block alone, so
    blocks can be split into chunks and the parts summed: the loss is the sum of the numerators over
    the sum of the weights. Callers pass `target_logits` only when `spec.needs_target`.
    """
    n, k, v = logits.shape
    logits = logits.float()
    if target_logits is not None and spec.labels == "target":
        labels = target_logits.argmax(-1)
    logp = F.log_softmax(logits, dim=-1)
    safe_labels = labels.clamp(min=0, max=v - 1)
    label_logp = torch.gather(logp, -1, safe_labels[..., None]).squeeze(-1)
    term = -label_logp
    alpha = torch.zeros_like(label_logp).detach()
    argmax_alpha = alpha
    if target_logits is not None:
        t = spec.kl_temperature
        log_pd = F.log_softmax(logits / t, dim=-1)
        log_pt = F.log_softmax(target_logits.float() / t, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_pd)).sum(-1)
        acc = torch.minimum(log_pd.exp(), log_pt.exp()).sum(-1)
        if spec.kl_weight > 0:
            term = (1.0 - spec.kl_weight) * term + spec.kl_weight * (t * t) * kl
        if spec.lk:
            term = (1.0 - spec.lk_weight) * term + spec.lk_weight * lk_terms(spec, acc, kl)[0]
        alpha = acc.detach()
        argmax_alpha = log_pt.detach().exp().gather(-1, logits.detach().argmax(-1, keepdim=True)).squeeze(-1)
    weight = _weights(label_logp.exp(), valid, spec)
    with torch.no_grad():
        top8 = logits.topk(min(8, v), dim=-1).indices
        hit = top8 == safe_labels[..., None]
        stats = (hit[..., 0] & valid, hit[..., :4].any(-1) & valid, hit.any(-1) & valid, alpha * valid,
                 argmax_alpha * valid)
    return (weight * term).sum(), weight.sum().detach(), stats


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, /, *, gamma: float,
                target_logits: torch.Tensor | None = None, **knobs) -> LossTerms:
    """The DFlash objective over N blocks of K positions; `knobs` are the other `LossSpec` fields.

    Per position k (1-based) and block n, with z the drafter's logits and t the target's:
        base  = (1 - a) * CE(z, label) + a * T^2 * KL(softmax(t/T) || softmax(z/T))     a = kl_weight
        term  = (1 - b) * base + b * LK                        b = lk_weight if lk else 0 (`lk_terms`)
        weight_nk = (1 - lambda) * d_nk + lambda * s_nk        lambda = streak_weight
            d_nk = exp(-(k-1)/gamma), or the D-PACE weight (position_weighting = dpace)
            s_nk = prod_{i<k} softmax(z_ni)[label_ni]          streak reach, detached
        loss  = sum(valid * weight * term) / sum(valid * weight)
    T = kl_temperature. label = the data's next token, or argmax t (labels = target). Without
    target_logits every term that needs them is off (a = b = 0, data labels). A batch with no
    valid position gives loss 0 (with a graph, so lockstep backward still runs).

    This holds every [N, K, V] intermediate at once; `chunked_dflash_loss` computes the same
    value and gradient from hidden states with O(chunk x V) memory.
    """
    spec = LossSpec(gamma, **knobs)
    if target_logits is None or not spec.needs_target:
        spec, target_logits = spec.without_target(), None
    num, weight_sum, (correct, in_top4, in_top8, alpha, argmax_alpha) = _loss_parts(logits, labels, valid, spec,
                                                                                     target_logits)
    has = target_logits is not None
    return LossTerms(num / weight_sum.clamp(min=1e-12), correct, in_top4, in_top8, valid, weight_sum,
                     alpha if has else None, argmax_alpha if has else None)


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: LossSpec,
                         target_logits: torch.Tensor | None, need_grad: bool, pad_to: int = 0,
                         top8: torch.Tensor | None = None):
    """`_loss_parts` of one chunk plus d(numerator)/d(logits) (in the logits' dtype, [c, K, V]): `_chunk_core` on
    the chunk's c x K rows. Where the core runs compiled (static shapes, components/fusion.py) a chunk of fewer
    than `pad_to` blocks is padded to it with invalid positions (their weight is 0: nothing changes). `top8`
    ([c, K, min(8, V)] ids, largest first): the logits' top-8 when the caller already has it (eager: the core
    then runs no top-k of its own; compiled, it counts the label's rank and ignores it)."""
    c, k = labels.shape
    compiled = compiles_for(logits)
    pad = max(pad_to - c, 0) if compiled else 0

    def rows(t: torch.Tensor | None, fill=0) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.reshape(c * k, *t.shape[2:])
        return torch.cat([t, t.new_full((pad * k, *t.shape[1:]), fill)]) if pad else t

    num, weight_sum, stats, dz = _chunk_core(rows(logits), rows(labels, -100), rows(valid, False), k, spec,
                                             rows(target_logits), need_grad, None if compiled else top8)
    if pad:
        stats, dz = [s[:c] for s in stats], None if dz is None else dz[: c * k]
    return num, weight_sum, stats, None if dz is None else dz.view(c, k, -1)


@fused(dynamic=False)
def _chunk_core(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, k: int, spec: LossSpec,
                target_logits: torch.Tensor | None, need_grad: bool, top8: torch.Tensor | None = None):
    """`_loss_parts` of c blocks of k positions (logits [c*k, V], labels and valid [c*k], target_logits [c*k, V])
    plus d(numerator)/d(logits) [c*k, V] in the logits' dtype, by hand, with few [c, k, V] buffers; compiled on
    CUDA (components/fusion.py: the passes below fuse into a few kernels). `logits` is detached: its buffer may
    be reused for the gradient when it is fp32.

    With p = softmax(z), p_d = softmax(z/T), p_t = softmax(t/T), the (detached) weights w and
    m = [p_d < p_t] (the subgradient of min), S = sum(p_d * m):
        d CE / dz = p - onehot(label)        d KL / dz = (p_d - p_t) / T
        d alpha / dz = p_d * (m - S) / T     (alpha = sum min(p_d, p_t))
    so d/dz [w term] = w ((1-b)(1-a) (p - onehot) + c_kl (p_d - p_t) + c_alpha p_d (m - S)) with
    c_kl = (1-b) a T + b dLK/dKL / T and c_alpha = b dLK/dalpha / T (`lk_terms`). Every buffer is
    reused in place: about 8 bytes per (position x vocabulary entry) with hard labels, 16 with the
    target's distribution and 17 with LK in fp32, against 12.4 / 32.5 for the autograd graph of
    `_loss_parts` (CE / KL).
    """
    v = logits.shape[-1]
    z = logits.float().view(-1, k, v)
    labels, valid = labels.view(-1, k), valid.view(-1, k)
    if target_logits is not None:
        target_logits = target_logits.view(-1, k, v)
    with torch.no_grad():
        if target_logits is not None and spec.labels == "target":
            labels = target_logits.argmax(-1)
        y = labels.clamp(min=0, max=v - 1)[..., None]
        zy = z.gather(-1, y)
        if torch.compiler.is_compiling():
            # The label's rank (how many logits beat it) fuses into the passes over z where top-k is a kernel of
            # its own (6% of an H200 step); a tie counts for the label (eager top-k breaks it by index).
            rank = (z > zy).sum(-1)
            stats = [(rank < 1) & valid, (rank < 4) & valid, (rank < 8) & valid]
            top1 = z.argmax(-1, keepdim=True)
        else:
            top8 = z.topk(min(8, v), dim=-1).indices if top8 is None else top8.view(-1, k, top8.shape[-1])
            hit = top8 == y
            stats = [hit[..., 0] & valid, hit[..., :4].any(-1) & valid, hit.any(-1) & valid]
            top1 = top8[..., :1]
            del top8, hit
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        label_logp = (zy - lse).squeeze(-1)
        weight = _weights(label_logp.exp(), valid, spec)
        term, alpha = -label_logp, torch.zeros_like(label_logp)
        argmax_alpha = alpha
        kl_w = spec.kl_weight if target_logits is not None else 0.0
        lk_w = spec.lk_weight if target_logits is not None and spec.lk else 0.0
        c_kl = c_alpha = None
        if target_logits is not None:
            t = spec.kl_temperature
            scratch = target_logits.float() / t
            scratch -= torch.logsumexp(scratch, dim=-1, keepdim=True)  # log p_t
            p_d = z / t
            p_d -= torch.logsumexp(p_d, dim=-1, keepdim=True)  # log p_d, exponentiated below
            p_t = scratch.exp()
            argmax_alpha = p_t.gather(-1, top1).squeeze(-1)
            kl = scratch.sub_(p_d).mul_(p_t).sum(-1)  # scratch is free again
            p_d.exp_()
            alpha = torch.minimum(p_d, p_t, out=scratch).sum(-1)
            if kl_w > 0:
                term = (1.0 - kl_w) * term + kl_w * (t * t) * kl
                c_kl = (1.0 - lk_w) * kl_w * t * weight
            if lk_w > 0:
                lk, d_alpha, d_kl = lk_terms(spec, alpha, kl)
                term = (1.0 - lk_w) * term + lk_w * lk
                c_alpha = lk_w / t * d_alpha * weight
                if spec.lk == "hybrid":
                    c_kl = (0.0 if c_kl is None else c_kl) + lk_w / t * d_kl * weight
        stats += [alpha * valid, argmax_alpha * valid]
        num = (weight * term).sum()
        dz = None
        if need_grad:
            c_ce = ((1.0 - lk_w) * (1.0 - kl_w) * weight)[..., None]
            # p, eager: in z's buffer (the head's backward does not read its output). Compiled, the graph writes a
            # buffer of its own anyway: mutating an fp32 input there only adds a write-back of it
            dz = (z - lse).exp() if torch.compiler.is_compiling() else z.sub_(lse).exp_()
            dz.mul_(c_ce)
            if torch.compiler.is_compiling():  # the one-hot as a compare: one pointwise kernel, no scatter pass
                dz.sub_((torch.arange(v, device=dz.device) == y) * c_ce)
            else:
                dz.scatter_add_(-1, y, -c_ce)
            if c_alpha is not None:  # coefficient of p_d: c_kl + c_alpha (m - S), m = [p_d < p_t]
                below = p_d < p_t
                s = torch.mul(p_d, below, out=scratch).sum(-1)
                ck = 0.0 if c_kl is None else c_kl
                torch.where(below, (ck + c_alpha * (1.0 - s))[..., None], (ck - c_alpha * s)[..., None], out=scratch)
                dz.addcmul_(scratch, p_d)
            elif c_kl is not None:
                dz.addcmul_(p_d, c_kl[..., None])
            if c_kl is not None:
                dz.sub_(p_t.mul_(c_kl[..., None]))
            dz = dz.to(logits.dtype).view(-1, v)
    return num, weight.sum(), stats, dz


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum over chunks of blocks of the unnormalised loss of `head(hidden)`, never holding all logits.

    The forward pass computes each chunk's logits, loss numerator and the numerator's gradient
    with respect to the logits (`_chunk_loss_and_grad`), carries it back through the head to
    that chunk's hidden states, then frees the chunk: peak memory is one chunk's [c, K, V]
    buffers. Backward only scales the stored [N, K, H] gradient. The head is frozen.
    """

    @staticmethod
    def forward(ctx, hidden, labels, valid, target_hidden, head, spec, chunk, need_grad, top_k, bias_embed, bias_w):
        # bias_embed [N, K, r] and bias_w [r, V] (DSpark's Markov head, or None): logits = head(h) + e @ w,
        # both differentiable, so the chunk's logits gradient also goes to e and w (an [r, V] sum over chunks)
        n = hidden.shape[0]
        grad = torch.zeros_like(hidden) if need_grad else None
        biased = bias_embed is not None
        grad_e = torch.zeros_like(bias_embed) if need_grad and biased else None
        grad_w = torch.zeros_like(bias_w) if need_grad and biased else None
        num = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weight_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        stats: list[list[torch.Tensor]] = [[], [], [], [], []]  # correct, top4, top8, alpha, argmax_alpha
        cands: list[list[torch.Tensor]] = [[], [], []]  # the head's top-k ids and logits, the label's logit
        k = hidden.shape[1]
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            with torch.enable_grad():
                inputs = [hidden[lo:hi].detach().requires_grad_(need_grad)]
                # The head as one [c*K, H] x [H, V] GEMM: `hidden` is usually a strided view (positions 1.. of each
                # block), and a 3-D input that cannot be viewed as 2-D makes matmul broadcast the V x H head into a
                # batched GEMM of c skinny [K, H] products, reading the whole head once per block (docs/DESIGN.md §9:
                # 47% of an H200 step). reshape copies the chunk (c*K*H) only when it must.
                flat = head(inputs[0].reshape(-1, inputs[0].shape[-1]))
                if biased:
                    inputs += [bias_embed[lo:hi].detach().requires_grad_(need_grad),
                               bias_w.detach().requires_grad_(need_grad)]
                    # into the head's output by the bias GEMM itself (beta 1): no [c*K, V] buffer for e @ w or the sum
                    flat = flat.addmm_(inputs[1].reshape(-1, inputs[1].shape[-1]).to(flat.dtype),
                                       inputs[2].to(flat.dtype))
            # The gradient is taken at `flat`, not at this view: the eager core overwrites fp32 logits in place, and a
            # changed view's gradient runs an as_strided backward (a zero-fill and a copy of the [c*K, V] chunk).
            logits = flat.detach().view(hi - lo, k, -1)
            top8 = None
            if top_k:
                with torch.no_grad():  # in the run dtype (exact in fp32 after): no fp32 copy of the chunk
                    values, ids = logits.topk(top_k, dim=-1)
                    gold = logits.gather(-1, labels[lo:hi].clamp(min=0, max=logits.shape[-1] - 1)[..., None])
                for acc, t in zip(cands, (ids, values.float(), gold.squeeze(-1).float())):
                    acc.append(t)
                n8 = min(8, logits.shape[-1])
                top8 = ids[..., :n8] if top_k >= n8 else None  # the metrics' top-8: no second top-k pass
            target_logits = (head(target_hidden[lo:hi].reshape((hi - lo) * k, -1)).view(hi - lo, k, -1)
                             if target_hidden is not None else None)
            part, w, st, dz = _chunk_loss_and_grad(logits, labels[lo:hi], valid[lo:hi], spec, target_logits,
                                                   need_grad, pad_to=chunk, top8=top8)
            del target_logits
            if need_grad:
                grads = torch.autograd.grad(flat, inputs, dz.view(flat.shape))
                grad[lo:hi] = grads[0]
                if biased:
                    grad_e[lo:hi] = grads[1]
                    grad_w += grads[2]
            num += part
            weight_sum += w
            for acc, t in zip(stats, st):
                acc.append(t)
            del inputs, flat, logits, dz
        ctx.save_for_backward(grad, grad_e, grad_w)
        outs = (weight_sum, *(torch.cat(acc) for acc in stats), *(torch.cat(acc) for acc in cands if acc))
        ctx.mark_non_differentiable(*outs)
        return (num, *outs)

    @staticmethod
    def backward(ctx, g_num, *_):
        grads = [None if g is None else g * g_num.to(g.dtype) for g in ctx.saved_tensors]
        return grads[0], None, None, None, None, None, None, None, None, grads[1], grads[2]


def chunked_dflash_loss(hidden: torch.Tensor, head, labels: torch.Tensor, valid: torch.Tensor, /, *, gamma: float,
                        target_hidden: torch.Tensor | None = None, chunk_blocks: int = 64,
                        logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None, top_k: int = 0,
                        **knobs) -> LossTerms:
    """`dflash_loss(head(hidden), ...)` computed `chunk_blocks` blocks at a time (same value and gradient).

    hidden [N, K, H]: the drafter's final-normed states of the predicted positions; head maps
    [..., H] to vocabulary logits (the target's frozen LM head). target_hidden [N, K, H]: the
    target's final hidden state at the same positions, for the terms that read the target's
    distribution (KL, LK, target labels; its logits are computed chunk by chunk too). `logit_bias` (e [N, K, r],
    w [r, V]): a low-rank bias e @ w added to the drafter's logits (DSpark's Markov head), never held whole;
    both get gradients. `top_k` > 0 also returns each position's top-k of the logits and its label's logit
    (`LossTerms.candidates`), taken from the chunk's logits. `knobs`: the other `LossSpec` fields.
    Peak memory is O(chunk_blocks x K x V) instead of O(N x K x V): about
    8 bytes per (label position x vocabulary entry) of a chunk for CE, 16 with the target's
    distribution, 17 with LK (fp32 buffers; plus the heads' own outputs in the run dtype).
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    spec = LossSpec(gamma, **knobs)
    if target_hidden is None or not spec.needs_target:
        spec, target_hidden = spec.without_target(), None
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or logit_bias is not None
                                             and any(t.requires_grad for t in logit_bias))
    num, weight_sum, correct, in_top4, in_top8, alpha, argmax_alpha, *cands = _ChunkedHeadLoss.apply(
        hidden, labels, valid, target_hidden, head, spec, chunk_blocks, need_grad, top_k,
        *(logit_bias if logit_bias is not None else (None, None)))
    has = target_hidden is not None
    return LossTerms(num / weight_sum.clamp(min=1e-12), correct, in_top4, in_top8, valid, weight_sum,
                     alpha if has else None, argmax_alpha if has else None, tuple(cands) if cands else None)
