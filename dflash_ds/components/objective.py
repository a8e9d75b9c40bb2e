"""One drafter forward + loss on a batch of captured target states (shared by every trainer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_ds.components.anchors import block_inputs_and_labels, sample_anchors
from dflash_ds.components.confidence import CONFIDENCE_SUMS, confidence_loss
from dflash_ds.components.loss import LossTerms, acceptance_sums, chunked_dflash_loss, loss_knobs, metric_sums
from dflash_ds.components.selector_loss import SELECTOR_SUMS, selector_loss
from dflash_ds.components.weights import decay_weights
from dflash_ds.config import LossConfig
from dflash_ds.models.drafter import DFlashDrafter


@dataclass
class TargetStates:
    """What a target rank produces for one batch (and what the bridge carries)."""

    input_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] long
    lengths: torch.Tensor  # [B] long
    context: torch.Tensor  # [B, S, n*H] selected target layers, concatenated
    last_hidden: torch.Tensor | None  # [B, S, H] final normed hidden (for the KL / LK terms, target labels)


def drafter_objective(drafter: DFlashDrafter, embed, lm_head, states: TargetStates, loss_cfg: LossConfig, *,
                      anchor_gen: torch.Generator, noise_std: float = 0.0,
                      noise_gen: torch.Generator | None = None) -> tuple[LossTerms, dict[str, torch.Tensor]]:
    """Sample anchors, run all blocks under the block-sparse mask, and compute the DFlash loss.

    `embed` maps token ids to embeddings and `lm_head` hidden states to logits (the target's,
    frozen: modules or functions). The logits are never materialised for the whole batch: the
    head and the loss run `loss_cfg.chunk_blocks` blocks at a time (`chunked_dflash_loss`).
    `anchor_gen` seeds the anchors, drawn on the batch's device (a generator on another device
    lends its seed, `sample_anchors`): one host read, the anchors' width.
    """
    arch = drafter.arch
    bs = arch.block_size
    anchors, valid = sample_anchors(states.loss_mask, states.lengths, bs, loss_cfg.num_anchors, anchor_gen,
                                    max_total=loss_cfg.max_anchors_per_batch)
    blocks, labels, label_valid = block_inputs_and_labels(states.input_ids, states.loss_mask, states.lengths,
                                                          anchors, valid, bs, arch.mask_token_id)
    context = states.context
    if noise_std > 0:
        noise = torch.randn(context.shape, generator=noise_gen, device=context.device, dtype=torch.float32)
        context = context + (noise * noise_std).to(context.dtype)
    with torch.no_grad():
        block_embeds = embed(blocks)
    hidden = drafter.forward_train(context, block_embeds.to(context.dtype), anchors)
    dev = hidden.device
    b, a = anchors.shape
    n = b * a
    target_hidden = None
    if loss_cfg.needs_last_hidden and states.last_hidden is not None:
        # The target's distribution for x_{a+k} is lm_head(final hidden at a+k-1): computed on this
        # side, chunk by chunk, instead of shipping vocabulary-sized logits over the wire. Without
        # it (a batch that does not carry it) the loss drops the terms that need it, as before.
        pos = (anchors[:, :, None] + torch.arange(bs - 1, device=anchors.device)).clamp(max=context.shape[1] - 1)
        last = states.last_hidden
        target_hidden = torch.gather(last, 1, pos.reshape(b, -1, 1).expand(-1, -1, last.shape[-1])).view(n, bs - 1, -1)
    flat_hidden, flat_labels = hidden[:, :, 1:, :].reshape(n, bs - 1, -1), labels.reshape(n, bs - 1)
    markov = getattr(drafter, "markov_head", None)  # DSpark (models/dspark.py): the Markov bias, teacher-forced
    embed_prev = bias = None
    if markov is not None:
        # position k reads the token before it: the anchor, then the gold labels (0 where there is none)
        prev = torch.cat([blocks[:, :, :1].reshape(n, 1), flat_labels[:, :-1].clamp(min=0)], dim=1)
        embed_prev = markov.embed(prev)
        # markov_w2 as [r, V] through the module's own forward (bias of the identity), never its .weight: under
        # ZeRO-3 a parameter is whole only inside its module's forward, and its gradient must flow back through it
        eye = torch.eye(embed_prev.shape[-1], device=dev, dtype=embed_prev.dtype)
        bias = (embed_prev, markov.bias(eye))
    selector = getattr(drafter, "candidate_selector", None)  # DFlash2 (models/dflash2.py): the selector term
    selecting = selector is not None and loss_cfg.selector_weight > 0
    terms = chunked_dflash_loss(flat_hidden, lm_head, flat_labels, label_valid.reshape(n, bs - 1),
                                target_hidden=target_hidden, chunk_blocks=loss_cfg.chunk_blocks, logit_bias=bias,
                                top_k=arch.options.selector_top_k if selecting else 0, **loss_knobs(loss_cfg))
    sums = {**metric_sums(terms), **acceptance_sums(terms)}
    sums["anchors"] = valid.sum().float()
    sums.update({k: torch.zeros((), device=dev) for k in (*SELECTOR_SUMS, *CONFIDENCE_SUMS)})
    conf = None if markov is None else drafter.confidence_logits(flat_hidden, embed_prev)
    if conf is not None and loss_cfg.confidence_weight > 0:
        # sampled: DeepSpec's alpha (the greedy hit where the batch has no target distribution); greedy: the hit
        aim = terms.alpha if loss_cfg.confidence_target == "sampled" else None
        conf_loss, conf_sums = confidence_loss(conf, aim, terms.correct, terms.valid,
                                               decay_weights(bs - 1, loss_cfg.gamma, dev))
        terms.loss = terms.loss + loss_cfg.confidence_weight * conf_loss
        sums.update(conf_sums)
    if selecting:  # its candidates are the DFlash loss's top-K: the head runs once per step
        o = arch.options  # the selector's kind's options (DFlash2Options)
        sel_loss, sel_sums = selector_loss(
            flat_hidden, lm_head, selector, flat_labels,
            label_valid.reshape(n, bs - 1), blocks[:, :, 0].reshape(n), top_k=o.selector_top_k,
            output_multiplier=o.output_multiplier, softcap=o.final_logit_softcapping, gamma=loss_cfg.gamma,
            detach=loss_cfg.selector_detach, gold_rule=loss_cfg.selector_gold, chunk_blocks=loss_cfg.chunk_blocks, candidates=terms.candidates)
        terms.loss = terms.loss + loss_cfg.selector_weight * sel_loss
        sums.update(sel_sums)
    return terms, sums
