"""One drafter forward + loss on a batch of captured target states (shared by every trainer).

The loss is DFlash's plus what the drafter's kind adds, asked of its loss module (models/kinds.py `kind_loss`:
DFlash2's selector term, DSpark's Markov bias and confidence term): nothing here knows a kind's parts or fields."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_ds.components.anchors import block_inputs_and_labels, sample_anchors
from dflash_ds.components.loss import LossTerms, acceptance_sums, chunked_dflash_loss, loss_knobs, metric_sums
from dflash_ds.components.noise import noisy_context
from dflash_ds.config import LossConfig
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.kinds import DraftedPositions, KindTerms, kind_loss


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
                      noise_seed: int = 0) -> tuple[LossTerms, dict[str, torch.Tensor]]:
    """Sample anchors, run all blocks under the block-sparse mask, and compute the DFlash loss.

    `embed` maps token ids to embeddings and `lm_head` hidden states to logits (the target's,
    frozen: modules or functions). The logits are never materialised for the whole batch: the
    head and the loss run `loss_cfg.chunk_blocks` blocks at a time (`chunked_dflash_loss`).
    `anchor_gen` seeds the anchors, drawn on the batch's device (a generator on another device
    lends its seed, `sample_anchors`): one host read, the anchors' width. `noise_std` > 0 adds Gaussian noise
    to the context, drawn by `noise_seed` (components/noise.py: the same values a sequence-parallel rank draws
    for its shard).
    """
    arch = drafter.arch
    bs = arch.block_size
    anchors, valid = sample_anchors(states.loss_mask, states.lengths, bs, loss_cfg.num_anchors, anchor_gen,
                                    max_total=loss_cfg.max_anchors_per_batch)
    blocks, labels, label_valid = block_inputs_and_labels(states.input_ids, states.loss_mask, states.lengths,
                                                          anchors, valid, bs, arch.mask_token_id)
    context = noisy_context(states.context, noise_std, noise_seed)
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
    flat_valid = label_valid.reshape(n, bs - 1)
    own = kind_loss(arch.kind)  # the kind's own terms and statistics (None: DFlash's loss alone)
    at = DraftedPositions(flat_hidden, flat_labels, flat_valid, blocks[:, :, 0].reshape(n), lm_head)
    extra = KindTerms() if own is None else own.loss_terms(drafter, at, loss_cfg)
    terms = chunked_dflash_loss(flat_hidden, lm_head, flat_labels, flat_valid, target_hidden=target_hidden,
                                chunk_blocks=loss_cfg.chunk_blocks, **extra.dflash_args, **loss_knobs(loss_cfg))
    sums = {**metric_sums(terms), **acceptance_sums(terms)}
    sums["anchors"] = valid.sum().float()
    if own is not None:  # every step carries the kind's statistics, zero where its term is off
        sums.update({k: torch.zeros((), device=dev) for k in own.SUMS})
    if extra.finish is not None:
        term, kind_sums = extra.finish(terms)
        if term is not None:
            terms.loss = terms.loss + term
        sums.update(kind_sums)
    return terms, sums
