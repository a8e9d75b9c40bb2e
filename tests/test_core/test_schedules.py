"""LR and noise schedules are pure functions of the step with the documented end points."""

import math

from dflash_ds.components.schedules import lr_at, noise_std_at


def test_lr_schedule_end_points():
    kw = dict(peak=1e-3, warmup_steps=10, total_steps=101, min_ratio=0.1)
    assert lr_at(0, **kw) == 0.0
    assert lr_at(5, **kw) == 5e-4
    assert lr_at(10, **kw) == 1e-3
    assert math.isclose(lr_at(100, **kw), 1e-4)
    mid = 10 + 45  # halfway through the cosine
    assert math.isclose(lr_at(mid, **kw), 1e-4 + 0.9e-3 * 0.5)
    assert all(lr_at(s, **kw) >= lr_at(s + 1, **kw) for s in range(10, 100))


def test_noise_schedule_end_points():
    kw = dict(max_std=0.2, min_std=0.05, warmup_steps=20, total_steps=201)
    assert noise_std_at(0, **kw) == 0.0
    assert math.isclose(noise_std_at(10, **kw), 0.1)
    assert noise_std_at(20, **kw) == 0.2
    assert math.isclose(noise_std_at(200, **kw), 0.05)
    assert noise_std_at(5, max_std=0.0, min_std=0.0, warmup_steps=0, total_steps=10) == 0.0
