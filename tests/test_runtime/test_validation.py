"""est_tau in the records, the validation split and checkpoints/best (docs/DESIGN.md §3-4).

The stream: held-out rows never trained on, the same split on every call, validation micro-steps
after the training ones of each evaluation step with ids that name their drafter, the same after
a resume; a separate validation folder. The checkpoint folder: keep-K rotation spares `best`, and a
resume remembers the better of the checkpoint's best and `best`'s own figures. End to end: 1 target
+ 2 drafters under ZeRO-3 (several forwards per estimate: the drafters agree on their count) walk at the
est_tau_interval steps only, log est_tau pooled over the walks of the window in every record and val_* at
the evaluation steps, keep the best checkpoint through keep-K rotation, and a colocated resume reads the
walks back and does not replace a better best with a worse one.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest

from conftest_runtime import COMMON
from runtime_utils import REPO, make_dataset, read_jsonl, torchrun, wandb_history_keys

TINY = REPO / "configs/tiny.yaml"


def stream(setup, **data_overrides):
    from dflash_ds.config import load_config
    from dflash_ds.data.stream import open_data

    target, data = setup
    cfg = load_config(TINY, {"target": str(target), "data": {"path": str(data), "token_budget": 1024,
                                                             **data_overrides},
                             "train": {"eval_interval": 3, "eval_batches": 3}})
    return cfg, open_data(cfg, 2, 512)


def test_held_out_rows_are_never_trained_and_the_split_is_fixed(setup) -> None:
    from dflash_ds.data.batching import Cursor

    _, data = stream(setup, val_fraction=0.1)
    val_ids = {i for spec in data.val_specs for i in spec.sample_ids}
    assert len(data.rows) == 96 - 10 and len(data.val_specs) == 3
    assert not set(data.rows.tolist()) & val_ids
    trained = {i for _, specs in itertools.islice(data.steps(Cursor(0, 0)), 200) for s in specs for i in s.sample_ids}
    assert trained == set(data.rows.tolist())  # every training row, over a few epochs, and no held-out one
    assert stream(setup, val_fraction=0.1)[1].val_specs == data.val_specs  # a pure function of the seed


def test_validation_micro_steps_follow_each_evaluation_step(setup) -> None:
    from dflash_ds.data.batching import Cursor

    _, data = stream(setup, val_fraction=0.1)
    walk = list(data.micro_steps(0, Cursor(0, 0), 6))
    assert [(ms.step, ms.val) for ms in walk] == [(0, False), (1, False), (2, False), (2, True), (2, True),
                                                  (3, False), (4, False), (5, False), (5, True), (5, True)]
    val = [ms for ms in walk if ms.val]
    assert [ms.index for ms in val] == [-1, -2, -3, -4]
    assert [[ms.batch_id(d) for d in (0, 1)] for ms in val] == [[-2, -1], [-4, -3], [-6, -5], [-8, -7]]
    assert all(ms.batch_id(d) % 2 == d for ms in val for d in (0, 1))  # Layout.drafter_rank_for finds the drafter
    v = data.val_specs  # 3 batches over 2 drafters: 2 micro-steps each, the first batch evaluated twice
    assert [ms.specs for ms in val[:2]] == [[v[0], v[1]], [v[2], v[0]]]
    assert not data.is_eval_step(0) and data.is_eval_step(2)
    after_step_2 = walk[2].after
    resumed = list(data.micro_steps(3, after_step_2, 6))
    assert resumed == walk[5:]  # a resume walks the same batches, validation included


def test_a_separate_validation_folder(setup, tmp_path) -> None:
    from datasets import load_from_disk

    from dflash_ds.data.stream import load_batch

    target, _ = setup
    val_dir = make_dataset(target, tmp_path / "val", n=12, max_length=256, block_size=8)
    _, data = stream(setup, val_path=str(val_dir))
    assert len(data.dataset) == 96 + 12 and len(data.rows) == 96
    rows = sorted(i for spec in data.val_specs for i in spec.sample_ids)
    assert rows and rows[0] >= 96
    spec = data.val_specs[0]
    got = load_batch(data.dataset, spec)
    val = load_from_disk(str(val_dir))
    first = val[spec.sample_ids[0] - 96]["input_ids"]
    assert got["input_ids"][0, :len(first)].tolist() == first


@pytest.mark.parametrize("overrides, message", [
    ({"data": {"val_fraction": 0.1, "val_path": "x"}}, "choose one validation split"),
    ({"train": {"eval_interval": 5}}, "needs a validation split"),
    ({"data": {"val_fraction": 1.0}}, "data.val_fraction = 1.0 must be in [0, 1)"),
])
def test_validation_config_errors(overrides, message) -> None:
    from dflash_ds.config import load_config
    from dflash_ds.errors import DFlashError

    with pytest.raises(DFlashError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, overrides)


def fake_checkpoint(root, step: int, val: float | None = None, best: dict | None = None):
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    state = {"step": step, **({"val": {"val_est_tau": val}} if val is not None else {}),
             **({"best": best} if best else {})}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "COMPLETE").write_text(f"{step}\n")
    return folder


def test_rotation_spares_best_and_resume_keeps_the_better_best(tmp_path) -> None:
    from dflash_ds.runtime import checkpoint as ckpt
    from dflash_ds.runtime.resume import best_so_far

    root = ckpt.checkpoint_root(tmp_path)
    for step, val in ((2, 3.0), (4, None), (6, 2.5), (8, None)):
        fake_checkpoint(root, step, val, {"step": 2, "val_est_tau": 3.0})
    (root / ckpt.BEST).write_text("step_00000002\n")
    ckpt._prune(root, 1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000008"]
    assert ckpt.find_best(tmp_path) == root / "step_00000002"
    # Resuming from an older checkpoint whose own record of the best is lower: checkpoints/best's figures win.
    assert best_so_far({"best": {"step": 1, "val_est_tau": 2.0}}, tmp_path) == {"step": 2, "val_est_tau": 3.0}
    assert best_so_far({"best": {"step": 9, "val_est_tau": 3.5}}, tmp_path) == {"step": 9, "val_est_tau": 3.5}
    assert not ckpt.improves(math.nan, None) and ckpt.improves(1.0, None)
    assert not ckpt.improves(3.0, {"val_est_tau": 3.0})  # a tie is no improvement
    ckpt.forget_best(tmp_path)
    assert ckpt.find_best(tmp_path) is None and best_so_far({}, tmp_path) is None


def run_args(setup, out, *extra):
    target, data = setup
    return [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--zero-stage", "3",
            "--data.val_fraction", "0.1", "--train.eval_interval", "4", "--train.save_interval", "6",
            "--train.keep_last", "1", "--loss.max_anchors_per_batch", "24", "--train.est_tau_interval", "3",
            "--train.est_tau_window", "16", *DSPARK, *extra]


# The runs of this file train a DSpark drafter with DeepSpec's objective (its end-to-end run: DeepSpeed ZeRO-3 over
# the Markov and confidence heads, est_tau and val_* through its Markov chain, a resume of its kind).
DSPARK = ("--model.kind", "dspark", "--model.markov_rank", "16", "--loss.lk", "l1", "--loss.lk_weight", "0.9")


def interval_tau(out, done: int, interval: int = 3) -> float:
    """The training tau est_tau scales to: every block of the record windows closed in the last est_tau_interval
    (3) steps, from records/uniform0.jsonl (the last line of a step: a resumed run appends); drafter 1's the same."""
    windows = [{rec["step"]: rec for rec in read_jsonl(out / "records" / f"uniform{d}.jsonl")} for d in (0, 1)]
    assert windows[0] == windows[1]  # the windows' sums over both drafters
    inside = [w for step, w in windows[0].items() if done - interval < step <= done]
    return 1 + sum(w["streak"] for w in inside) / sum(w["blocks"] for w in inside)


def pooled_walks(out, done: int, tau: float) -> dict[str, float]:
    """est_tau, est_tau_pooled and est_tau_walked of the last 2 walks up to step `done` (est_tau_window 16 rows = 2
    walks of 4 rows on 2 drafters) over both drafters, from their files (the last line of a step: a resumed run
    appends), scaled to the training `tau` of the last est_tau_interval steps (components/acceptance.calibrated_walk)."""
    from dflash_ds.components.acceptance import WALK_SUMS, calibrated_walk

    sums = dict.fromkeys(WALK_SUMS, 0.0)
    for d in (0, 1):
        walks = {rec["step"]: rec for rec in read_jsonl(out / "records" / f"walks{d}.jsonl")}
        for step in sorted(s for s in walks if s <= done)[-2:]:
            for key in WALK_SUMS:
                sums[key] += walks[step][key]
    return calibrated_walk(sums, tau)


@pytest.fixture(scope="module")
def validated(setup, tmp_path_factory):
    """1 target + 2 drafters, ZeRO-3, 12 steps: records at 4, 5, 8, 10, 12, evaluations at 4, 8, 12, W&B offline."""
    out = tmp_path_factory.mktemp("validated")
    r = torchrun(3, run_args(setup, out, "--max-steps", "12", "--wandb.enabled", "true"), cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


def test_records_carry_est_tau_and_val_figures_at_evaluations(validated) -> None:
    records = read_jsonl(validated / "metrics.jsonl")
    assert [rec["step"] for rec in records] == [4, 5, 8, 10, 12]
    for d in (0, 1):  # est_tau_interval 3: the walks, and only they
        assert [w["step"] for w in read_jsonl(validated / "records" / f"walks{d}.jsonl")] == [3, 6, 9, 12]
    for rec in records:
        assert 1.0 <= rec["est_tau"] <= 8.0 and 1.0 <= rec["est_tau_pooled"] <= 8.0, rec
        base = interval_tau(validated, rec["step"])  # e.g. step 10: the windows closed at 8 and 10
        assert rec["est_tau_base"] == pytest.approx(base), rec
        want = pooled_walks(validated, rec["step"], base)  # e.g. step 10: the walks at 6 and 9
        for key in ("est_tau", "est_tau_pooled", "est_tau_walked"):
            assert rec[key] == pytest.approx(want[key]), (rec["step"], key)
        has_val = rec["step"] % 4 == 0
        assert {"val_est_tau", "val_est_tau_pooled", "val_tau"} <= rec.keys() if has_val else "val_tau" not in rec
        # DSpark: the L1 term's half, 0.5 ||q - p||_1 (its value against an independent computation:
        # tests/test_models/test_dspark.py), and the confidence head's calibration, logged apart
        assert 0 < rec["tv_distance"] < 1 and 0 <= rec["confidence_ece"] <= 1, rec
        assert 0 <= rec["confidence_brier"] <= 1 and rec["confidence_loss"] > 0, rec
    # The L1 term trains: the drafter's distribution comes closer to the target's over the run.
    assert records[-1]["tv_distance"] < records[0]["tv_distance"], [rec["tv_distance"] for rec in records]
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.runtime import checkpoint as ckpt

    last = validated / "checkpoints" / "step_00000012"
    assert ckpt.read_state(last)["arch"]["kind"] == "dspark"
    assert ckpt.read_state(last)["arch"]["dspark_options"]["markov_rank"] == 16
    assert json.loads((last / "export" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert DFlashDrafter.from_pretrained(last / "export").kind == "dspark"
    logged = wandb_history_keys(next(validated.glob("wandb/offline-run-*/run-*.wandb")))
    assert {"train/tau", "train/est_tau", "train/est_tau_pooled", "val/val_est_tau", "val/val_tau",
            "train/confidence_ece"} <= logged
    # The drafters' per-batch records hold their training batches only, one per step.
    for d in (0, 1):
        assert [x["batch_id"] for x in read_jsonl(validated / "records" / f"drafter{d}.jsonl")] == \
            [s * 2 + d for s in range(12)]


def test_best_checkpoint_is_the_best_evaluation_and_survives_rotation(validated) -> None:
    from dflash_ds.runtime import checkpoint as ckpt

    evals = [rec for rec in read_jsonl(validated / "metrics.jsonl") if "val_est_tau" in rec]
    winner = max(evals, key=lambda rec: rec["val_est_tau"])  # the first of equal ones: a tie is no improvement
    best = ckpt.find_best(validated)
    state = ckpt.read_state(best)
    assert state["step"] == winner["step"]
    assert state["val"] == {k: winner[k] for k in ("val_est_tau", "val_est_tau_pooled", "val_tau")}
    assert state["best"] == {"step": winner["step"], "val_est_tau": winner["val_est_tau"]}
    kept = sorted(p.name for p in ckpt.checkpoint_root(validated).glob("step_*"))
    assert kept == sorted({best.name, "step_00000012"})  # keep_last 1, and the best


def test_a_resume_keeps_a_better_best_through_rotation(setup, validated, tmp_path) -> None:
    """The best's figures raised to 99 (a best no later evaluation reaches); a colocated resume to step 20
    evaluates at 16 and 20, rotates its checkpoints (keep_last 1) and leaves best where it was."""
    import shutil

    from dflash_ds.runtime import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(validated, run, ignore=shutil.ignore_patterns("wandb"))
    best = ckpt.find_best(run)
    state = ckpt.read_state(best)
    state["val"]["val_est_tau"] = 99.0
    (best / "trainer_state.json").write_text(json.dumps(state))
    r = torchrun(2, run_args(setup, run, "--max-steps", "20", "--no-wandb", "--colocate"), cwd=run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resuming from" in r.stdout and "at step 12" in r.stdout
    records = read_jsonl(run / "metrics.jsonl")
    assert [rec["step"] for rec in records] == [4, 5, 8, 10, 12, 15, 16, 20]
    assert all("val_est_tau" in rec for rec in records if rec["step"] in (16, 20))
    # Step 15's record pools the walks at 12 (the first run's, read back) and 15 (the resumed run's).
    assert [w["step"] for w in read_jsonl(run / "records" / "walks0.jsonl")] == [3, 6, 9, 12, 15, 18]
    # ... scaled to the training tau of the window closed at 15 (the first run's at 12 is 3 steps back)
    assert records[5]["est_tau"] == pytest.approx(pooled_walks(run, 15, interval_tau(run, 15))["est_tau"])
    assert ckpt.find_best(run) == run / "checkpoints" / best.name
    final = ckpt.read_state(run / "checkpoints" / "step_00000020")
    assert final["best"] == {"step": state["step"], "val_est_tau": 99.0}
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == sorted({best.name, "step_00000020"})
