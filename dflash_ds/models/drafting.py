"""What a drafter that drafts sequentially returns (models/drafter.py `DFlashDrafter.sequential`)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockDraft(NamedTuple):
    """What a drafter that drafts sequentially (`draft_tokens`: DFlash2's walk, DSpark's Markov chain) returns for
    N blocks of L drafted positions: tokens [N, L]; the logits each token was drawn from [N, L, C], over the
    `candidates` [N, L, C] ids (DFlash2's top-K) or, when that is None, over the whole vocabulary (DSpark, bias
    included); the confidence head's probabilities [N, L] (None: no head)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
