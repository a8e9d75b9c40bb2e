"""Warm start: a drafter of another kind built from a trained DFlash export, drafting exactly as it at step 0.

The backbone (fc, hidden_norm, layers, norm) is copied; the parts the new kind adds start where they change
nothing (peers do the same: speculators' DSpark example, SpecForge's DFlash2):
- DSpark: markov_w2 = 0, so the Markov bias is 0 and the chain drafts the backbone's argmax; the confidence
  head is free (it drafts nothing).
- DFlash2: identity convolutions (tap 0 = 1, projections 0) and a zero successor codebook, so every edge score
  is 0 and the walk takes the best unary candidate, the head's argmax (with input_embedding_scale 1; a positive
  output_multiplier and a soft cap keep the order).
Fine-tuning a released drafter of the same kind needs none of this: it is loaded as it is.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash_ds.errors import DFlashError
from dflash_ds.models.dflash2_arch import DFlash2Options
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.dspark_arch import DSparkOptions
from dflash_ds.models.kinds import DFLASH, DFLASH2, DSPARK


def warm_start(source: DFlashDrafter, kind: str, options: DFlash2Options | DSparkOptions | None = None,
               seed: int = 0) -> DFlashDrafter:
    """A `kind` drafter with `source`'s backbone and the new parts at identity / zero (module doc)."""
    if kind == source.kind:
        return source
    if source.kind != DFLASH:
        raise DFlashError(f"a warm start builds a dflash2 or dspark drafter from a dflash export; this one is "
                          f"{source.kind} (its own parts would be dropped and its drafts would change)")
    if kind == DFLASH2:
        opts = options or DFlash2Options()
        if opts.input_embedding_scale != 1.0:
            raise DFlashError("a warm start needs input_embedding_scale 1 (another scale changes the backbone's "
                              "inputs, so the drafts would change)")
        arch = dataclasses.replace(source.arch, dflash2=opts, dspark=None)
    elif kind == DSPARK:
        arch = dataclasses.replace(source.arch, dflash2=None, dspark=options or DSparkOptions())
    else:
        raise DFlashError(f"a warm start builds a dflash2 or dspark drafter, not {kind!r}")
    drafter = DFlashDrafter(arch)
    drafter.init_weights(seed)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("rotary_emb.")}
    missing = drafter.load_state_dict(state, strict=False)
    if missing.unexpected_keys:  # pragma: no cover - a dflash backbone is a subset of every kind's
        raise DFlashError(f"warm start: tensors {missing.unexpected_keys[:3]} have no place in a {kind} drafter")
    with torch.no_grad():
        if kind == DFLASH2:
            drafter.candidate_selector.successor_codebook.zero_()
        else:
            drafter.markov_head.markov_w2.weight.zero_()
    return drafter.to(next(source.parameters()).dtype)
