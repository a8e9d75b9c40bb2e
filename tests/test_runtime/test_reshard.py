"""A global batch fixed in the config, and resume on another drafter (and target) count.

Two uninterrupted 1-target + 2-drafter runs with train.global_batch 4 (2 accumulated micro-batches
per drafter), ZeRO-2 and ZeRO-3, checkpoint at step 4 of 8. Every other run is compared with them
batch by batch (records carry the global batch id of every micro-batch): the ZeRO-3 run with the
ZeRO-2 one, a fresh ZeRO-1 run on one drafter, and each step-4 checkpoint resumed on 1 drafter (fed
by 2 targets: routing over several targets) and on 4 drafters.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest_runtime import COMMON
from runtime_utils import per_batch, read_jsonl, torchrun

STEPS, HALF = 8, 4


def args_for(setup, out, *extra):
    target, data = setup
    return [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--no-wandb",
            "--max-steps", str(STEPS), "--train.save_interval", str(HALF), "--train.log_interval", "2", *extra]


def assert_same_batches(got: dict, want: dict, steps: range, tol: float = 1e-4) -> None:
    """The same batch ids at the same steps, and per-batch losses within tol."""
    ids = sorted(b for b, r in want.items() if r["step"] in steps)
    assert ids == list(range(steps.start * 4, steps.stop * 4))  # a step is 4 global batches
    for b in ids:
        assert got[b]["step"] == want[b]["step"], (b, got[b], want[b])
        assert abs(got[b]["loss"] - want[b]["loss"]) < tol, (b, got[b]["loss"], want[b]["loss"])
    extra = sorted(b for b, r in got.items() if r["step"] in steps and b not in want)
    assert not extra, extra


def _g4_run(setup, tmp_path_factory, stage: int):
    """1 target + 2 drafters, global batch 4, ZeRO `stage`, 8 steps, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp(f"g4ref_z{stage}")
    r = torchrun(3, args_for(setup, out, "--train.global_batch", "4", "--zero-stage", str(stage)), cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return stage, out


@pytest.fixture(scope="module")
def g4_zero2(setup, tmp_path_factory):
    return _g4_run(setup, tmp_path_factory, 2)


@pytest.fixture(scope="module")
def g4_zero3(setup, tmp_path_factory):
    return _g4_run(setup, tmp_path_factory, 3)


def test_zero3_trains_as_zero2(g4_zero2, g4_zero3):
    """Same math, another partitioning of the optimizer (and of the parameters): fp32 round-off only."""
    assert_same_batches(per_batch(g4_zero3[1]), per_batch(g4_zero2[1]), range(0, STEPS))


def test_reference_accumulates_two_micro_batches_per_drafter(g4_zero2):
    stage, out = g4_zero2
    for d in (0, 1):
        recs = read_jsonl(out / "records" / f"drafter{d}.jsonl")
        # drafter d trains micro-batch m of step s = global batch s * 4 + m * 2 + d
        assert [(x["step"], x["micro"], x["batch_id"]) for x in recs] == [
            (s, m, s * 4 + m * 2 + d) for s in range(STEPS) for m in range(2)]
    state = json.loads((out / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert (state["num_drafters"], state["global_batch"], state["zero_stage"]) == (2, 4, stage)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [2, 4, 6, 8]


def test_global_batch_4_on_one_drafter_equals_two(setup, g4_zero2, tmp_path):
    """The same global batch on 1 drafter (4 accumulated micro-batches) trains the same steps; run under
    ZeRO-1, which also shows ZeRO-1 training as ZeRO-2 does (the reference)."""
    _, ref = g4_zero2
    r = torchrun(2, args_for(setup, tmp_path, "--train.global_batch", "4", "--train.stop_at", str(HALF),
                             "--zero-stage", "1"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert_same_batches(per_batch(tmp_path), per_batch(ref), range(0, HALF))
    got, want = read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")[:2]
    assert [m["step"] for m in got] == [2, 4]
    for a, b in zip(got, want):  # a step's loss is over its whole global batch, whatever D is
        assert abs(a["loss"] - b["loss"]) < 1e-4 and a["label_positions"] == b["label_positions"], (a, b)


# Each stage reshards once, each direction once (ZeRO-2 -> 1 drafter fed by 2 targets, ZeRO-3 -> 4 drafters):
# the conversion is the same code for both stages, the load differs by the new drafter count.
@pytest.mark.parametrize("stage, drafters, targets", [(2, 1, 2), (3, 4, 1)],
                         ids=["zero2-to1drafter_2targets", "zero3-to4drafters"])
def test_resume_on_another_drafter_count(setup, request, tmp_path, stage, drafters, targets):
    """The step-4 checkpoint of the 2-drafter run resumes on D' drafters: the remaining batches and losses
    are the uninterrupted run's (1e-4); the shards were converted to the universal format once."""
    from dflash_ds.runtime.resume import checkpoint_info

    stage, ref = request.getfixturevalue(f"g4_zero{stage}")
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copytree(ref / "checkpoints" / "step_00000004", ckpts / "step_00000004")
    (ckpts / "latest").write_text("step_00000004\n")
    r = torchrun(drafters + targets, args_for(setup, tmp_path, "--zero-stage", str(stage),
                                              "--num-target-ranks", str(targets)), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resharded from 2 drafter rank(s)" in r.stdout, r.stdout[-3000:]
    got, want = per_batch(tmp_path), per_batch(ref)
    assert_same_batches(got, want, range(HALF, STEPS))
    if targets == 2:  # batches alternate over the two targets
        assert {got[b]["target_rank"] for b in range(HALF * 4, STEPS * 4)} == {1, 2}
    info = checkpoint_info(ckpts / "step_00000008")
    assert (info["num_drafters"], info["global_batch"], info["zero_stage"]) == (drafters, 4, stage)
    assert checkpoint_info(ckpts / "step_00000004")["universal_converted"]


def test_checkpoint_that_cannot_be_split_fails_before_any_model(g4_zero2, capsys):
    """3 drafters cannot split a global batch of 4; an explicit other global batch is refused: one error each,
    from the JSON alone (choose_resume runs on every rank before any process group or model)."""
    from dflash_ds.cli import main
    from dflash_ds.config import load_config
    from dflash_ds.errors import DFlashError
    from dflash_ds.runtime.resume import choose_resume

    _, ref = g4_zero2
    ckpt = ref / "checkpoints" / "step_00000004"
    cfg = load_config(COMMON[1], {"train": {"resume": str(ckpt), "output_dir": str(ref)}})
    with pytest.raises(DFlashError, match=r"global batch 4 cannot be split over 3 drafter ranks.*: 1, 2, 4"):
        choose_resume(cfg, 3)
    cfg.train.global_batch = 8
    with pytest.raises(DFlashError, match=r"global batch of 4 .* asks train.global_batch = 8"):
        choose_resume(cfg, 2)
    cfg.train.global_batch = 0
    plan = choose_resume(cfg, 1)
    assert (plan.global_batch, plan.mode, plan.saved_drafters) == (4, "universal", 2)
    assert choose_resume(cfg, 2).mode == "direct"

    assert main(["ckpt", "info", str(ref), "--drafters", "1", "3"]) == 1  # the run folder: its latest (step 8)
    out = capsys.readouterr().out
    assert "step            8 of 8" in out and "global batch    4 micro-batches per step (2 per drafter)" in out
    assert "1 drafter rank(s): yes (resharded: universal)" in out
    assert "3 drafter rank(s): no: global batch 4 cannot be split over 3 drafter ranks" in out
    assert main(["ckpt", "info", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4 and info["resume_on_drafters"]["2"] == "yes (shards as written)"


@pytest.fixture(scope="module")
def in_process(setup, tmp_path_factory) -> dict:
    """_accumulate_script.py's results: one process, world size 1, three engines."""
    import sys

    from proc_utils import run_bounded
    from runtime_utils import REPO, env_for_children

    target, _ = setup
    tmp = tmp_path_factory.mktemp("in_process")
    r = run_bounded([sys.executable, str(REPO / "tests/test_runtime/_accumulate_script.py"), str(target),
                     str(tmp / "pg"), COMMON[1]], 180, env=env_for_children(), cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_colocated_engine_shares_the_targets_head(in_process):
    """Built beside the loaded target (--colocate), the engine holds the target's own embedding / head tensors
    and its first step equals the one of an engine whose head was read from the safetensors."""
    assert in_process["colocated_shares_head"] is True
    assert in_process["colocated_diff"] == 0.0


def test_dropped_micro_batch_contributes_nothing(in_process):
    """With accumulation, a non-finite micro-batch is dropped from its step: the weights are those of a
    step on the other micro-batch alone (at half weight), and DeepSpeed still steps at every boundary."""
    got = in_process
    assert got["same_init"] == 0.0 and got["moved"] > 1e-4, got
    assert got["diff"] < 1e-6, got
    assert (got["steps_after_first"], got["steps_after_second"]) == (1, 2), got
