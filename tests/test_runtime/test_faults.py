"""Faults with real torchrun, gloo and DeepSpeed: a crash in a save and the restart, non-finite losses, a slow
leader. Faults are injected by environment (dflash_ds/runtime/faults.py); every comparison is against the
uninterrupted reference run of conftest.py. Lost ranks, signals and a lost launcher: test_reliability_table.py.
"""

from __future__ import annotations

from conftest_runtime import COMMON, STEPS
from runtime_utils import read_jsonl, torchrun


def records(out, d):
    return read_jsonl(out / "records" / f"drafter{d}.jsonl")


def assert_tail_matches_reference(out, ref_out, from_step):
    """After `from_step`, the trained batches and losses equal the uninterrupted run's."""
    for d in (0, 1):
        got = [r for r in records(out, d)]
        # the record keeps the interrupted attempt too: take the last occurrence of each step
        last = {r["step"]: r for r in got}
        want = {r["step"]: r for r in records(ref_out, d)}
        assert sorted(last) == list(range(STEPS))
        for step in range(from_step, STEPS):
            assert last[step]["batch_id"] == want[step]["batch_id"], (d, step)
            assert abs(last[step]["loss"] - want[step]["loss"]) < 1e-5, (d, step, last[step], want[step])


def args_for(setup, out, *extra):
    target, data = setup
    return [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--no-wandb", *extra]


def test_kill_during_save_then_restart_resumes_from_the_previous_checkpoint(setup, reference, tmp_path):
    """Drafter 1 is SIGKILLed inside the step-20 save: torchrun restarts the job (--max-restarts 1), which
    resumes from step 10 (the half-written step 20 never became `latest` and is cleaned up) and trains
    exactly the uninterrupted run's batches to the end."""
    ref_out, _ = reference
    r = torchrun(3, args_for(setup, tmp_path), extra=["--max-restarts", "1"],
                 env={"DFLASH_FAULT_RANK": "1", "DFLASH_FAULT_KILL_IN_SAVE": "20"}, timeout=420, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-5000:]
    assert "resuming from" in r.stdout and "step_00000010" in r.stdout, r.stdout[-3000:]
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000020"
    assert not list(root.glob("*.partial"))
    assert_tail_matches_reference(tmp_path, ref_out, from_step=10)


def test_nan_step_skipped_then_too_many_stop(setup, tmp_path):
    """One NaN (step 1) is skipped and counted; three in a row (steps 4-6) stop the run with the error."""
    r = torchrun(3, args_for(setup, tmp_path, "--train.save_interval", "2", "--train.max_bad_steps", "3",
                             "--train.log_interval", "1"),
                 env={"DFLASH_INJECT_NAN_STEPS": "1,4,5,6"}, timeout=300, cwd=tmp_path)
    assert r.returncode != 0
    assert "3 consecutive steps with a non-finite loss or gradient norm (last at step 6)" in r.stderr
    for d in (0, 1):
        assert [x["skipped"] for x in records(tmp_path, d)][:4] == [False, True, False, False]
    by_step = {m["step"]: m for m in read_jsonl(tmp_path / "metrics.jsonl")}
    assert by_step[2]["skipped_steps"] == 1 and by_step[4]["skipped_steps"] == 1
    assert by_step[5]["skipped_steps"] == 2
    # no checkpoint inside the streak: the last good one (after step 3) stays the latest
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_a_slow_leader_start_keeps_the_target(setup, tmp_path):
    """The leader takes longer than train.timeout_s before building its engine (a slow resume or resharding):
    the bridge was connected at start-up and the target waits for the start point under the start-up timeout,
    so it survives and the run trains."""
    r = torchrun(2, args_for(setup, tmp_path, "--max-steps", "4", "--train.timeout_s", "10"),
                 env={"DFLASH_FAULT_RANK": "0", "DFLASH_FAULT_BUILD_DELAY_S": "14"}, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert "[dflash-ds] bridge: 1 target-drafter pair(s) connected" in r.stdout, r.stdout[-3000:]
    assert [x["step"] for x in records(tmp_path, 0)] == list(range(4))
