"""Learning-rate and context-noise schedules as pure functions of the step."""

from __future__ import annotations

import math


def _warmup_cosine(step: int, peak: float, floor: float, warmup_steps: int, total_steps: int) -> float:
    """Linear 0 -> peak over warmup_steps, then cosine peak -> floor reached at the last step (total_steps - 1)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * step / warmup_steps
    last = total_steps - 1
    if last <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / (last - warmup_steps))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine to `peak * min_ratio` at the last step.

    `step` counts optimizer steps from 0; the last step is `total_steps - 1`.
    """
    return _warmup_cosine(step, peak, peak * min_ratio, warmup_steps, total_steps)


def noise_std_at(step: int, *, max_std: float, min_std: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from 0 to `max_std`, then cosine anneal from `max_std` to `min_std` at the last step."""
    if max_std == 0.0:
        return 0.0
    return _warmup_cosine(step, max_std, min_std, warmup_steps, total_steps)


def ramp_at(step: int, warmup_steps: int) -> float:
    """A weight's linear ramp: (step + 1) / warmup_steps over the first warmup_steps steps (0-based), then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)
