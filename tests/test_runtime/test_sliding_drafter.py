"""A sliding-window drafter end to end: train (1 target + 1 drafter, 2 steps), export, reload with its
layer types, resume-state check, and speculative decoding lossless against greedy at temperature 0."""

from __future__ import annotations

import json

import torch

from runtime_utils import REPO, torchrun

S, F = "sliding_attention", "full_attention"


def test_sliding_window_drafter_trains_exports_and_evaluates_losslessly(setup, tmp_path):
    from dflash_ds.eval.cli import evaluate, load_prompts
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target

    target, data = setup
    out = tmp_path / "run"
    # Window 5 < block 8: the window cuts inside the block as well as the context.
    r = torchrun(2, ["--config", str(REPO / "configs/tiny.yaml"), "--target", str(target), "--data", str(data),
                     "--output-dir", str(out), "--max-steps", "2", "--train.log_interval", "1",
                     "--data.token_budget", "512", "--train.timeout_s", "90", "--model.layer_types",
                     f"[{S}, {F}]", "--model.sliding_window", "5"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ck = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    cfg = json.loads((ck / "export" / "config.json").read_text())
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == ([S, F], 5, True)
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["arch"]["layer_types"] == [S, F] and state["arch"]["sliding_window"] == 5

    drafter = DFlashDrafter.from_pretrained(ck / "export").eval()
    assert drafter.arch.layer_types == [S, F] and drafter.arch.sliding_window == 5
    torch.set_num_threads(1)
    results = evaluate(load_target(target), drafter, load_prompts(data, target, 2), max_new_tokens=16,
                       temperature=0.0, log=lambda s: None)
    assert results["lossless_checked"] and results["mismatches"] == []
    assert results["tau"] >= 1.0
