"""Adaptive verification simulated on eval's records (eval/adaptive.py), by hand; the head's target read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ds.eval.adaptive import simulate
from dflash_ds.eval.cli import confidence_target_of


def test_top_fraction_by_running_product_by_hand() -> None:
    """Step A: confidences 0.9, 0.5, 0.2, 2 accepted; step B: 0.6, 0.9, 0.9, 0 accepted. Running products A .9 .45
    .09, B .6 .54 .486; ranked A1 B1 B2 B3 A2 A3. Top 2 of 6 (25%: ceil 1.5): A keeps 1, B 1 -> tokens
    (min(2,1)+1) + (0+1) = 3 over (1+1) + (1+1) = 4 verified = 0.75. Top 3 (50%): A 1, B 2 -> 3 / 5 = 0.6.
    All (full blocks): (2+1) + (0+1) = 4 over 4 + 4 = 0.5, 2 tokens a step."""
    got = simulate([([0.9, 0.5, 0.2], 2), ([0.6, 0.9, 0.9], 0)], fractions=(0.25, 0.5, 1.0))
    assert [g["verified_slots"] for g in got] == [2, 3, 6]
    assert [g["tokens_per_verified"] for g in got] == pytest.approx([0.75, 0.6, 0.5])
    assert [g["tokens_per_step"] for g in got] == pytest.approx([1.5, 1.5, 2.0])


def test_confidence_target_read_from_the_export(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dflash_ds_training": {"loss": {"confidence_target": "greedy"}}}))
    assert confidence_target_of(tmp_path) == "greedy"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    assert confidence_target_of(tmp_path) == "sampled"  # DeepSpec's, and exports written before the field
