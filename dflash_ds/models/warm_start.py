"""Warm start: a drafter of another kind built from a trained DFlash export, drafting exactly as it at step 0.

The backbone (fc, hidden_norm, layers, norm) is copied; the parts the new kind adds start where they change
nothing, as its spec's `warm_start` sets them (models/kinds.py; peers do the same: speculators' DSpark example,
SpecForge's DFlash2):
- DSpark: markov_w2 = 0, so the Markov bias is 0 and the chain drafts the backbone's argmax; the confidence
  head is free (it drafts nothing).
- DFlash2: identity convolutions (tap 0 = 1, projections 0) and a zero successor codebook, so every edge score
  is 0 and the walk takes the best unary candidate, the head's argmax (with input_embedding_scale 1; a positive
  output_multiplier and a soft cap keep the order).
Fine-tuning a released drafter of the same kind needs none of this: it is loaded as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.kinds import DFLASH, kind_specs


def warm_start(source: DFlashDrafter, kind: str, options: Any = None, seed: int = 0) -> DFlashDrafter:
    """A `kind` drafter with `source`'s backbone and the new parts where the kind's spec puts them (module doc);
    `options`: the kind's (None = its defaults)."""
    if kind == source.kind:
        return source
    can = {s.name: s for s in kind_specs() if s.warm_start is not None}
    if source.kind != DFLASH:
        raise DFlashError(f"a warm start builds a {' or '.join(can)} drafter from a dflash export; this one is "
                          f"{source.kind} (its own parts would be dropped and its drafts would change)")
    spec = can.get(kind)
    if spec is None:
        raise DFlashError(f"a warm start builds a {' or '.join(can)} drafter, not {kind!r}")
    arch = dataclasses.replace(source.arch, options=options if options is not None else spec.default_options())
    drafter = DFlashDrafter.seeded(arch, seed)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("rotary_emb.")}
    missing = drafter.load_state_dict(state, strict=False)
    if missing.unexpected_keys:  # pragma: no cover - a dflash backbone is a subset of every kind's
        raise DFlashError(f"warm start: tensors {missing.unexpected_keys[:3]} have no place in a {kind} drafter")
    spec.warm_start(drafter)
    return drafter.to(next(source.parameters()).dtype)
