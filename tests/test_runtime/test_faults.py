"""Reliability with real torchrun, gloo and DeepSpeed: lost ranks, restarts, preemption, crashes in a
save, non-finite losses. Faults are injected by environment (dflash_ds/runtime/faults.py); every
comparison is against the uninterrupted reference run of conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import time

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


def test_sigkill_drafter_every_rank_exits_and_names_it(setup, tmp_path):
    t0 = time.monotonic()
    r = torchrun(3, args_for(setup, tmp_path, "--train.timeout_s", "20", "--train.heartbeat_timeout_s", "10"),
                 env={"DFLASH_FAULT_RANK": "1", "DFLASH_FAULT_KILL_AT": "6"}, timeout=300, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "lost rank 1 (drafter 1)" in r.stderr, r.stderr[-4000:]
    assert elapsed < 240  # start-up plus at most about twice the timeouts; torchrun never hung


def test_sigterm_to_the_target_rank_checkpoints_the_step_and_exits_75(setup, tmp_path):
    """SIGTERM to the target rank (global rank 2) as it starts its step 7: the drafters finish the step they
    agree on, checkpoint it and every rank exits 75. (That such a checkpoint resumes to the uninterrupted
    run's batches is shown by test_colocated's SIGTERM + resume and by the kill-in-save restart below.)"""
    r1 = torchrun(3, args_for(setup, tmp_path), env={"DFLASH_FAULT_RANK": "2", "DFLASH_FAULT_TERM_AT": "7"},
                  timeout=300, cwd=tmp_path)
    assert r1.returncode != 0
    assert "exitcode  : 75" in r1.stderr, r1.stderr[-4000:]
    assert "stop requested (SIGTERM on rank 2)" in r1.stdout, r1.stdout[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    stop_step = int(latest.split("_")[1])
    assert 1 <= stop_step < STEPS
    assert max(r["step"] for r in records(tmp_path, 0)) == stop_step - 1  # finished the current step, no more
    state = json.loads((tmp_path / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == stop_step and (tmp_path / "checkpoints" / latest / "export" / "config.json").is_file()


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


def test_sigterm_to_the_launcher_checkpoints_current_step(setup, tmp_path):
    """torchrun forwards SIGTERM to every rank: they finish the step, checkpoint it and exit 75."""
    import signal
    import subprocess
    import sys

    from proc_utils import process_group
    from runtime_utils import env_for_children, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
           "-m", "dflash_ds.train", *args_for(setup, tmp_path, "--max-steps", "1000", "--train.log_interval", "1")]
    with process_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(),
                       cwd=tmp_path) as proc:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert "exiting with status 75" in out, out[-2000:] + err[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert step >= 3 and max(r["step"] for r in records(tmp_path, 0)) == step - 1


def test_sigkill_to_torchrun_leaves_no_rank_behind(setup, tmp_path):
    """A launcher killed hard cannot stop its ranks: they notice, checkpoint an agreed step and exit in < 30 s."""
    import os
    import signal
    import sys

    from proc_utils import children, process_group
    from runtime_utils import env_for_children, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
           "-m", "dflash_ds.train", *args_for(setup, tmp_path, "--max-steps", "1000", "--train.log_interval", "1")]
    ranks: list[int] = []
    # Files, not pipes: nobody reads a pipe once its launcher is dead, and a full pipe blocks the ranks.
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        try:
            with process_group(cmd, stdout=out, stderr=err, env=env_for_children(), cwd=tmp_path) as proc:
                deadline = time.monotonic() + 240
                metrics = tmp_path / "metrics.jsonl"
                while time.monotonic() < deadline and proc.poll() is None:
                    if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                        break
                    time.sleep(0.2)
                ranks = children(proc.pid)
                assert len(ranks) == 3, ranks
                os.kill(proc.pid, signal.SIGKILL)
                killed = time.monotonic()
                while time.monotonic() - killed < 45 and any(alive(p) for p in ranks):
                    time.sleep(0.2)
                took = time.monotonic() - killed
        finally:
            for p in ranks:  # never leave one behind, whatever the assertions below say
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
    log = (tmp_path / "err.txt").read_text() + (tmp_path / "out.txt").read_text()
    assert took < 30, (took, [p for p in ranks if alive(p)], log[-4000:])
    assert "launcher (pid" in log and "is gone" in log, log[-4000:]
    # the drafters could still agree: they checkpointed the step they stopped at
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert step >= 2 and max(r["step"] for r in records(tmp_path, 0)) == step - 1, log[-3000:]


def alive(pid: int) -> bool:
    """A process that still runs (a zombie waiting for init to reap it has finished)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_slow_leader_start_keeps_the_target(setup, tmp_path):
    """The leader takes longer than train.timeout_s before building its engine (a slow resume or resharding):
    the bridge was connected at start-up and the target waits for the start point under the start-up timeout,
    so it survives and the run trains."""
    r = torchrun(2, args_for(setup, tmp_path, "--max-steps", "4", "--train.timeout_s", "10"),
                 env={"DFLASH_FAULT_RANK": "0", "DFLASH_FAULT_BUILD_DELAY_S": "14"}, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert "[dflash-ds] bridge: 1 target-drafter pair(s) connected" in r.stdout, r.stdout[-3000:]
    assert [x["step"] for x in records(tmp_path, 0)] == list(range(4))
