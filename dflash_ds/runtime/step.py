"""The drafter's micro-step, as the trainer, `bench` and `train-step` all take it.

Anchors and noise of a batch come from generators seeded by (seed, global batch id), so a step
is a pure function of the batch and the weights: a resumed run and an uninterrupted one agree.
"""

from __future__ import annotations

ANCHOR_SALT, NOISE_SALT = 1, 2


def batch_seed(seed: int, global_batch: int, salt: int) -> int:
    """Seed of a per-batch generator (anchors, noise): a pure function, so resume is exact."""
    return (seed * 1_000_003 + global_batch * 7919 + salt) % (2**63 - 1)
