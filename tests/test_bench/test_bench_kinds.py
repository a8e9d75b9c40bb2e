"""`dflash-ds bench kinds`: each kind trains its own objective on the same data, resumes, and refuses mixed settings.

On the tiny target (natural prompts through its tokenizer, its own answers): three kinds, one depth, one seed, 12
steps, two worker processes. Each run's step-12 loss is recomputed here by `train_drafter` from a loss configuration
written out by hand (DSpark: DeepSpec's 0.1 CE + 0.9 L1 at gamma 4; the others the defaults): equal when the
bench trains the kind's recipe, and DSpark's differs from the same run on plain CE (so the check can fail).
"""

from __future__ import annotations

import json

import pytest

ARGS = ["--kinds", "dflash,dflash2,dspark", "--layers", "1", "--seeds", "0", "--steps", "0,12",
        "--train-prompts", "16", "--held-out", "3", "--answer-tokens", "12", "--eval-tokens", "8",
        "--batch", "4", "--anchors", "4", "--block-size", "4", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def bench_run(tiny_target, tmp_path_factory):
    """The bench's output folder and its summary, run once (in two spawned worker processes)."""
    from dflash_ds.cli import main

    out = tmp_path_factory.mktemp("kinds") / "out"
    assert main(["bench", "kinds", "--target", str(tiny_target), "--out", str(out), "--jobs", "2", "--keep-exports",
                 *ARGS]) == 0
    return out, json.loads((out / "summary.json").read_text())


def hand_loss(tiny_target, out, kind: str, loss_fields: dict, steps: int = 12) -> float:
    """The step-`steps` loss of a run trained here, in one thread as the bench's workers train."""
    import torch

    from dflash_ds.config import LossConfig
    from dflash_ds.eval.cli import load_prompts
    from dflash_ds.models.kinds import kind_spec
    from dflash_ds.models.target import load_target
    from dflash_ds.tiny.context_check import AblationConfig, train_drafter

    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    answers = {r["id"]: r["token_ids"][0] for r in map(json.loads, (out / "answers.jsonl").read_text().splitlines())}
    seqs = list(zip(load_prompts(out / "train.jsonl", tiny_target, len(rows)), [answers[r["id"]] for r in rows]))
    cfg = AblationConfig(steps=steps, batch=4, num_anchors=4, num_layers=1, block_size=4, lr=3e-3, seed=0)
    seen = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_drafter(load_target(tiny_target), tiny_target, seqs, cfg, out.parent / f"hand-{kind}",
                      options=kind_spec(kind).default_options(), loss_cfg=LossConfig(num_anchors=4, **loss_fields),
                      on_step=lambda step, _d, _n, loss: seen.update({step: loss}))
    finally:
        torch.set_num_threads(threads)
    return float(seen[steps])


def test_each_kind_trains_its_own_objective_on_the_same_data(bench_run, tiny_target):
    out, summary = bench_run
    runs = {(r["kind"], r["steps"]): r for r in summary["runs"]}
    assert sorted(runs) == [(k, s) for k in ("dflash", "dflash2", "dspark") for s in (0, 12)]
    for kind in ("dflash", "dflash2", "dspark"):
        untrained, trained = runs[(kind, 0)], runs[(kind, 12)]
        assert untrained["label_tokens"] == 0 and untrained["loss"] is None
        assert trained["label_tokens"] == runs[("dflash", 12)]["label_tokens"] > 0  # the same anchors for all
        assert trained["tau"] >= 1.0 and len(trained["acceptance"]) == 3
    deepspec = dict(gamma=4.0, lk="l1", lk_weight=0.9)
    assert runs[("dspark", 12)]["loss"] == pytest.approx(hand_loss(tiny_target, out, "dspark", deepspec), rel=1e-5)
    assert runs[("dspark", 12)]["loss"] != pytest.approx(hand_loss(tiny_target, out, "dspark", {}), rel=1e-3)
    assert runs[("dflash", 12)]["loss"] == pytest.approx(hand_loss(tiny_target, out, "dflash", {}), rel=1e-5)
    table = (out / "table.md").read_text()
    assert "| dspark | 1 | 12 |" in table and "| dflash2 | 1 | 0 |" in table
    assert not any((out / "init").iterdir())  # each run's untrained export is removed once it trained


def test_a_rerun_reads_results_back_and_other_settings_are_refused(bench_run, tiny_target, cli_here):
    out, summary = bench_run
    result = out / "runs" / "dflash-L1-s0" / "step12.json"
    before = result.stat().st_mtime_ns
    again = cli_here("bench", "kinds", "--target", str(tiny_target), "--out", str(out), *ARGS)
    assert again.returncode == 0, again.stderr
    assert result.stat().st_mtime_ns == before and "step 12: held-out tau" not in again.stdout  # nothing retrained
    assert json.loads((out / "summary.json").read_text())["runs"] == summary["runs"]
    other = [a if a != "3e-3" else "1e-3" for a in ARGS]
    refused = cli_here("bench", "kinds", "--target", str(tiny_target), "--out", str(out), *other)
    assert refused.returncode != 0 and "settings.json" in refused.stderr and "lr" in refused.stderr
    assert result.stat().st_mtime_ns == before


def test_kept_exports_serve_the_tau_their_runs_recorded(bench_run, tiny_target):
    """--keep-exports: each run's drafter at each budget is an export that `eval` serves at the recorded tau."""
    from dflash_ds.eval.cli import evaluate, load_prompts
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target

    out, summary = bench_run
    runs = {(r["kind"], r["steps"]): r for r in summary["runs"]}
    target = load_target(tiny_target)
    held = load_prompts(out / "held_out.jsonl", tiny_target, 3)
    for kind in ("dflash", "dspark"):
        export = out / "runs" / f"{kind}-L1-s0" / "step12"
        drafter = DFlashDrafter.from_pretrained(export).eval()
        assert drafter.kind == kind
        served = evaluate(target, drafter, held, max_new_tokens=8, log=lambda _s: None)
        assert served["mismatches"] == [] and served["tau"] == pytest.approx(runs[(kind, 12)]["tau"], abs=1e-9)
