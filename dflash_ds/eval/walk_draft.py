"""Sequential drafting in `eval`: a drafter that drafts token by token (`draft_tokens`), as vLLM 0.32 runs it.

Such a drafter drafts position by position, each token conditioned on the one drafted before it (its class, in its
kind's drafter module, says `sequential` and defines `draft_tokens`, returning a models/drafting.BlockDraft). At
T = 0, and at T > 0 with draft sampling "greedy" (vLLM's default `draft_sample_method`), each position takes its
best token; a greedy draft at T > 0 is a one-hot q. With "probabilistic" at T > 0 position k draws x_k from
softmax(z_k / T), z_k being the logits after the token drawn before it (a walk over candidates: the K scores of the
walked row, -inf off the candidates, as vLLM's `_selector_walk_kernel`; a chain over the whole vocabulary: the
logits with the kind's bias, as vLLM's `_sample_sequential`), and that distribution is q_k for speculative
sampling. q_k depends on the earlier draft tokens only, so the chain rule of `speculative._accept_sampled` keeps
the output distributed as the target's.

A drafter with a confidence head also reports, per drafted token, its estimate that the token is
accepted; `confidence_stop` P cuts the chain before the first token whose running product of confidences
falls below P (one token is always drafted), so a block the drafter doubts costs fewer verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dflash_ds.models.drafter import DFlashDrafter, DrafterCache


@dataclass
class WalkDraft:
    """A chain already drawn: its tokens, q [L, V] (None at T = 0) they were drawn from, and the confidence head's
    probability per token (None: no head)."""

    tokens: list[int]
    q: torch.Tensor | None
    confidence: list[float] | None = None
    # the full-vocabulary logits [L, V] each token was taken from (the kind's bias included; None for a walk over
    # candidates): eval's alpha = sum min(p, softmax(logits)) per token, the head's sampled target
    logits: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int]:
        """(L,): the drafted positions, as a draft function's logits report them."""
        return (len(self.tokens),)


def walk_q(candidate_ids: torch.Tensor | None, rows: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[L, V] draft distributions: softmax(row / T) on each position's candidates, 0 elsewhere (no candidates:
    the rows are over the whole vocabulary)."""
    probs = torch.softmax(rows.double() / temperature, dim=-1).float().cpu()
    if candidate_ids is None:
        return probs
    return torch.zeros(rows.shape[0], vocab).scatter_(1, candidate_ids.long().cpu(), probs)


def confidence_cut(confidence: list[float], threshold: float) -> int:
    """Tokens kept: up to the first whose running product of confidences falls below `threshold` (at least 1)."""
    keep, prod = 0, 1.0
    for c in confidence:
        prod *= c
        if prod < threshold and keep > 0:
            break
        keep += 1
    return keep


def walk_draft_fn(drafter: DFlashDrafter, target: nn.Module, temperature: float = 0.0, draft_sample: str = "greedy",
                  generator: torch.Generator | None = None,
                  confidence_stop: float | None = None) -> Callable[..., WalkDraft]:
    """A sequential drafter as a draft function returning WalkDraft, with its own DrafterCache (one per prompt)."""
    cache = DrafterCache(drafter.arch.num_hidden_layers)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    dtype = next(drafter.parameters()).dtype
    vocab = int(target.config.vocab_size)
    sampled = temperature > 0 and draft_sample == "probabilistic"

    @torch.no_grad()
    def draft(new_context: torch.Tensor | None, block_tokens: torch.Tensor, start: int) -> WalkDraft:
        block = embed(block_tokens.view(1, -1).to(embed.weight.device)).to(dtype)
        ctx = None if new_context is None else new_context.unsqueeze(0).to(dtype)
        hidden = drafter.forward_infer(ctx, block, start, cache)
        out = drafter.draft_tokens(hidden[:, 1:], lambda h: head(h.to(head.weight.dtype)),
                                   block_tokens[:1].to(hidden.device), temperature if sampled else 0.0, generator)
        chain = out.tokens[0].tolist()
        conf = None if out.confidence is None else out.confidence[0].float().tolist()
        keep = len(chain) if conf is None or confidence_stop is None else confidence_cut(conf, confidence_stop)
        chain, conf = chain[:keep], None if conf is None else conf[:keep]
        if sampled:
            cands = None if out.candidates is None else out.candidates[0, :keep]
            return WalkDraft(chain, walk_q(cands, out.logits[0, :keep], vocab, temperature), conf)
        if temperature > 0:  # the greedy walk as a one-hot q: accepted with probability p(x)
            return WalkDraft(chain, torch.zeros(keep, vocab).scatter_(1, out.tokens[0, :keep].cpu().view(-1, 1), 1.0),
                             conf)
        return WalkDraft(chain, None, conf, None if out.candidates is not None else out.logits[0, :keep].cpu())

    return draft
