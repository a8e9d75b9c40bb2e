"""`dflash-ds plan`: the split and the wire arithmetic, checked by hand (pure, in-process)."""

from __future__ import annotations

import json

import pytest

from dflash_ds.cli import main


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_8b_wire_bytes(capsys) -> None:
    p = plan_json(capsys, "--gpus", "8", "--hidden", "4096", "--vocab", "151936", "--drafter-layers", "5",
                  "--dtype-bytes", "2")
    w = p["wire_bytes_per_token"]
    ids = w["ids"]
    assert ids == 16  # int64 input_ids + int64 loss_mask, as the bridge sends them
    assert w["total"] == (5 * 4096 + 4096) * 2 + ids == 49168
    assert w["logits"] == 151936 * 2
    assert w["saved_per_token"] == 151936 * 2 - 4096 * 2
    assert w["logits_over_total"] == pytest.approx(303872 / 49168)  # 6.18x: bf16 logits alone
    assert w["alternative_over_total"] == pytest.approx((5 * 4096 * 2 + 303872 + 16) / 49168)  # 7.0x
    assert w["fp32_logits_over_total"] >= 10  # 12.4x against fp32 logits
    assert w["logits_over_last_hidden"] == pytest.approx(151936 / 4096)  # 37.1x: what replaces the logits
    assert p["split"] is None  # no rates given


def test_split_maximises_the_slower_side(capsys) -> None:
    p = plan_json(capsys, "--gpus", "8", "--target-tok-per-s", "20000", "--drafter-tok-per-s", "9000")
    best = p["split"]["best"]
    assert (best["target_ranks"], best["drafter_ranks"]) == (3, 5)  # min(60k, 45k) beats min(40k, 54k)
    assert best["tok_per_s"] == 45000
    assert p["links"]["per_drafter_in_bytes_per_s"] == pytest.approx(49168 * 45000 / 5)
    assert p["links"]["per_target_out_bytes_per_s"] == pytest.approx(49168 * 45000 / 3)


def test_per_node_split_and_bench_input(capsys, tmp_path) -> None:
    bench = tmp_path / "pipe.json"
    bench.write_text("some log line\n" + json.dumps({"target_capacity": {"tok_per_s_per_rank": 1000.0},
                                                     "drafter_capacity": {"tok_per_s_per_rank": 1000.0}}))
    p = plan_json(capsys, "--gpus", "16", "--nodes", "2", "--from-bench", str(bench))
    best = p["split"]["best"]
    assert best["targets_per_node"] == 4 and best["target_ranks"] == 8 and best["tok_per_s"] == 8000
    assert p["links"]["cross_node_fraction"] == 0.0  # per-node layout: routed within each node


def test_text_report_and_errors(capsys) -> None:
    assert main(["plan", "--gpus", "8", "--target-tok-per-s", "100", "--drafter-tok-per-s", "100"]) == 0
    out = capsys.readouterr().out
    assert "(5 x 4096 + 4096) x 2 + 16 = 49,168 B/token" in out and "recommended: 4 target + 4 drafter" in out
    assert main(["plan", "--gpus", "3", "--nodes", "2"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8", "--target-tok-per-s", "100"]) == 2
