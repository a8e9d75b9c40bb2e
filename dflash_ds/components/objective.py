"""One drafter forward + loss on a batch of captured target states (shared by every trainer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_ds.components.loss import (LossTerms, block_inputs_and_labels, dflash_loss, metric_sums,
                                       sample_anchors)
from dflash_ds.config import LossConfig
from dflash_ds.models.drafter import DFlashDrafter


@dataclass
class TargetStates:
    """What a target rank produces for one batch (and what the bridge carries)."""

    input_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] long
    lengths: torch.Tensor  # [B] long
    context: torch.Tensor  # [B, S, n*H] selected target layers, concatenated
    last_hidden: torch.Tensor | None  # [B, S, H] final normed hidden (for the KL term)


def drafter_objective(drafter: DFlashDrafter, embed: nn.Module, lm_head: nn.Module, states: TargetStates,
                      loss_cfg: LossConfig, *, anchor_gen: torch.Generator, noise_std: float = 0.0,
                      noise_gen: torch.Generator | None = None) -> tuple[LossTerms, dict[str, torch.Tensor]]:
    """Sample anchors, run all blocks under the block-sparse mask, and compute the DFlash loss."""
    arch = drafter.arch
    bs = arch.block_size
    anchors, valid = sample_anchors(states.loss_mask, states.lengths, bs, loss_cfg.num_anchors, anchor_gen)
    blocks, labels, label_valid = block_inputs_and_labels(states.input_ids, states.loss_mask, states.lengths,
                                                          anchors, valid, bs, arch.mask_token_id)
    context = states.context
    if noise_std > 0:
        noise = torch.randn(context.shape, generator=noise_gen, device=context.device, dtype=torch.float32)
        context = context + (noise * noise_std).to(context.dtype)
    with torch.no_grad():
        block_embeds = embed(blocks)
    hidden = drafter.forward_train(context, block_embeds.to(context.dtype), anchors)
    logits = lm_head(hidden[:, :, 1:, :])
    target_logits = None
    if loss_cfg.kl_weight > 0 and states.last_hidden is not None:
        # The target's distribution for x_{a+k} is lm_head(final hidden at a+k-1): computed here
        # instead of shipping vocabulary-sized logits over the wire.
        b, a = anchors.shape
        pos = (anchors[:, :, None] + torch.arange(bs - 1, device=anchors.device)).clamp(max=context.shape[1] - 1)
        h = torch.gather(states.last_hidden, 1, pos.reshape(b, -1, 1).expand(-1, -1, states.last_hidden.shape[-1]))
        with torch.no_grad():
            target_logits = lm_head(h).view(b * a, bs - 1, -1)
    n = logits.shape[0] * logits.shape[1]
    terms = dflash_loss(logits.reshape(n, bs - 1, -1), labels.reshape(n, bs - 1), label_valid.reshape(n, bs - 1),
                        gamma=loss_cfg.gamma, target_logits=target_logits, kl_weight=loss_cfg.kl_weight,
                        kl_temperature=loss_cfg.kl_temperature, streak_weight=loss_cfg.streak_weight)
    return terms, metric_sums(terms)
