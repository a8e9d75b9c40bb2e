"""Adaptive verification simulated on eval's records (eval/adaptive.py), by hand; the head's target read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ds.eval.adaptive import simulate
from dflash_ds.eval.cli import head_target_of


def test_top_fraction_by_running_product_by_hand() -> None:
    """Step A: confidences 0.9, 0.5, 0.2, 2 accepted; step B: 0.6, 0.9, 0.9, 0 accepted. Running products A .9 .45
    .09, B .6 .54 .486; ranked A1 B1 B2 B3 A2 A3. Top 2 of 6 (25%: ceil 1.5): A keeps 1, B 1 -> tokens
    (min(2,1)+1) + (0+1) = 3 over (1+1) + (1+1) = 4 verified = 0.75. Top 3 (50%): A 1, B 2 -> 3 / 5 = 0.6.
    All (full blocks): (2+1) + (0+1) = 4 over 4 + 4 = 0.5, 2 tokens a step."""
    got = simulate([[([0.9, 0.5, 0.2], 2)], [([0.6, 0.9, 0.9], 0)]], fractions=(0.25, 0.5, 1.0))  # one step each
    assert [g["verified_slots"] for g in got] == [2, 3, 6]
    assert [g["tokens_per_verified"] for g in got] == pytest.approx([0.75, 0.6, 0.5])
    assert [g["tokens_per_step"] for g in got] == pytest.approx([1.5, 1.5, 2.0])


def test_slots_are_ranked_within_a_step() -> None:
    """vLLM ranks the slots of one step, never against another step's. Prompt P: steps (0.9, 0.9) 2 accepted, then
    (0.2, 0.2) 1; prompt Q: (0.8, 0.8) 0, then (0.1, 0.1) 0. Half the slots: step 1 ranks P .9 .81 Q .8 .64 and
    keeps P's two; step 2 ranks P .2 .04 Q .1 .01 and keeps P 1, Q 1 -> tokens 3 + 1 + 2 + 1 = 7 over 3 + 1 + 2 + 2
    = 8 verified. Pooled over both steps the top 4 would be step 1's four slots: 3 + 1 + 1 + 1 = 6 over 8."""
    got = simulate([[([0.9, 0.9], 2), ([0.2, 0.2], 1)], [([0.8, 0.8], 0), ([0.1, 0.1], 0)]], fractions=(0.5,))
    assert got[0]["verified_slots"] == 4 and got[0]["tokens_per_verified"] == pytest.approx(7 / 8)
    assert got[0]["tokens_per_step"] == pytest.approx(7 / 4)


def test_confidence_target_read_from_the_export(tmp_path: Path) -> None:
    """The kind reads its own recorded loss field (models/dspark_arch.head_target): eval names no kind's field."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"],
                                                      "dflash_ds_training": {"loss": {"confidence_target": "greedy"}}}))
    assert head_target_of(tmp_path) == "greedy"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    assert head_target_of(tmp_path) == "sampled"  # DeepSpec's, and exports written before the field


def test_eval_reports_the_heads_own_target(tiny_target: Path) -> None:
    """A DSpark drafter through `evaluate` at T = 0: the calibration in front is the one the head trained for (the
    other beside it), each labelled; the adaptive simulation's full-block row is the run's own tokens per verified
    token, sum of accepted lengths / sum of (block_size) verified per step."""
    import torch

    from dflash_ds.eval.cli import evaluate
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.dspark_arch import DSparkOptions
    from dflash_ds.models.from_target import drafter_arch_from_target
    from dflash_ds.models.target import load_target

    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=4, options=DSparkOptions(markov_rank=4))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    target = load_target(str(tiny_target), dtype=torch.float32, device="cpu")
    for aim, other in (("greedy", "sampled"), ("sampled", "greedy")):
        r = evaluate(target, drafter.eval(), [[1, 5, 9, 13]], max_new_tokens=12, head_target=aim, log=lambda s: None)
        mine, theirs = r["confidence_calibration"], r["confidence_calibration_other"]
        assert (mine["trained_for"], mine["judged_against"], theirs["judged_against"]) == (aim, aim, other)
        assert mine["judged_tokens"] == theirs["judged_tokens"] and 0 <= mine["brier"] <= 1
        assert mine["acceptance_rate"] != theirs["acceptance_rate"]  # the hit rate and the mean alpha: two targets
    full = r["adaptive_verification"][-1]
    assert full["fraction"] == 1.0 and full["verified_slots"] == 3 * r["decode_steps"]
    assert full["tokens_per_verified"] == pytest.approx(r["tau_pooled"] / 4)
