"""Learning-rate and context-noise schedules as pure functions of the step."""

from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine to `peak * min_ratio` at the last step.

    `step` counts optimizer steps from 0; the last step is `total_steps - 1`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * step / warmup_steps
    last = total_steps - 1
    if last <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / (last - warmup_steps))
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def noise_std_at(step: int, *, max_std: float, min_std: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to `max_std`, then cosine anneal from `max_std` to `min_std` at the last step."""
    if max_std == 0.0:
        return 0.0
    if warmup_steps > 0 and step < warmup_steps:
        return max_std * step / warmup_steps
    last = total_steps - 1
    if last <= warmup_steps:
        return max_std
    progress = min(1.0, (step - warmup_steps) / (last - warmup_steps))
    return min_std + (max_std - min_std) * 0.5 * (1.0 + math.cos(math.pi * progress))
