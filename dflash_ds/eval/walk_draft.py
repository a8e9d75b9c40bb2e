"""DFlash2 drafting in `eval`: the candidate selector's walk, as vLLM 0.32's DFlash2 speculator runs it.

At T = 0, and at T > 0 with draft sampling "greedy" (vLLM's default `draft_sample_method`), the walk is
greedy: the draft is its tokens, accepted while the target's own choice (or sample) agrees; a greedy draft
at T > 0 is a one-hot q. With "probabilistic" at T > 0 each position draws x_k from
softmax(row_k / T) over its K candidates, row_k being the scores after the token drawn before it
(`_selector_walk_kernel`: Gumbel-max over the row at the request's temperature), and that K-way
distribution is q_k for speculative sampling (vLLM caches the row as the draft logits, -inf elsewhere,
and its rejection sampler divides them by T). q_k depends on the earlier draft tokens only, so the
chain rule of `speculative._accept_sampled` keeps the output distributed as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dflash_ds.models.drafter import DFlashDrafter, DrafterCache


@dataclass
class WalkDraft:
    """A chain the walk has already drawn: its tokens and q [L, V] (None at T = 0), what they were drawn from."""

    tokens: list[int]
    q: torch.Tensor | None

    @property
    def shape(self) -> tuple[int]:
        """(L,): the drafted positions, as a draft function's logits report them."""
        return (len(self.tokens),)


def walk_q(candidate_ids: torch.Tensor, rows: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """[L, V] draft distributions: softmax(row / T) on each position's K candidates, 0 elsewhere."""
    probs = torch.softmax(rows.double() / temperature, dim=-1).float()
    return torch.zeros(rows.shape[0], vocab).scatter_(1, candidate_ids.long().cpu(), probs.cpu())


def walk_draft_fn(drafter: DFlashDrafter, target: nn.Module, temperature: float = 0.0, draft_sample: str = "greedy",
                  generator: torch.Generator | None = None) -> Callable[..., WalkDraft]:
    """A DFlash2 drafter as a draft function returning WalkDraft, with its own DrafterCache (one per prompt)."""
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
        tokens, ids, rows = drafter.draft_tokens(hidden[:, 1:], lambda h: head(h.to(head.weight.dtype)),
                                                 block_tokens[:1].to(hidden.device),
                                                 temperature if sampled else 0.0, generator)
        chain = tokens[0].tolist()
        if sampled:
            return WalkDraft(chain, walk_q(ids[0], rows[0], vocab, temperature))
        if temperature > 0:  # the greedy walk as a one-hot q: accepted with probability p(x)
            return WalkDraft(chain, torch.zeros(len(chain), vocab).scatter_(1, tokens[0].cpu().view(-1, 1), 1.0))
        return WalkDraft(chain, None)

    return draft
