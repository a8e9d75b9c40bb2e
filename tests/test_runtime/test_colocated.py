"""Colocated training (--colocate): every rank runs the target and trains the drafter, no bridge.

Compared with the uninterrupted 1 target + 2 drafter reference run of conftest.py (same data,
seed, ZeRO-2, 20 steps): a 2-rank colocated run with the step's elementwise work compiled (train.fuse)
trains the same global batches at the same steps with the same losses; its step-10 checkpoint resumed under the deepspeed launcher reproduces its
own second half bit for bit; one colocated rank accumulating the reference's global batch of 2
trains it too, through a SIGTERM (checkpoint, exit 75) and a resume, and its export evaluates
losslessly; the reference's own checkpoint resumes colocated, and a killed rank is named.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from conftest_runtime import COMMON, STEPS
from proc_utils import run_bounded
from runtime_utils import (env_for_children, exit_statuses, free_port, per_batch, read_jsonl, torchrun,
                           torchrun_exit_codes)


def args_for(setup, out, *extra):
    target, data = setup
    return [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--no-wandb",
            "--zero-stage", "2", "--colocate", *extra]


def export_weights(out, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "export" / "model.safetensors"))


# The colocated run and its resume compile the step's elementwise work as a GPU run does (train.fuse true: the
# loss core and the layer ops through inductor on CPU), against the eager reference run.
FUSED = ("--train.fuse", "true")


@pytest.fixture(scope="module")
def colocated(setup, tmp_path_factory):
    """torchrun --nproc_per_node 2 ... --colocate: 20 steps, checkpoints at 10 and 20; every tensor handed to
    torch.distributed audited as if the groups were the GPU ones (distributed/audit.py)."""
    out = tmp_path_factory.mktemp("colocated")
    r = torchrun(2, args_for(setup, out, *FUSED), cwd=out,
                 env={"DFLASH_DIST_AUDIT": str(out / "audit"), "DFLASH_DIST_AUDIT_AS": "nccl"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out, r.stdout


def test_two_colocated_ranks_train_the_disaggregated_runs_batches(colocated, reference):
    out, stdout = colocated
    ref_out, _ = reference
    assert "2 colocated rank(s): each runs the target forward and trains the drafter" in stdout
    got, want = per_batch(out), per_batch(ref_out)
    assert sorted(got) == sorted(want) == list(range(2 * STEPS))
    for b, rec in want.items():
        assert got[b]["step"] == rec["step"] and got[b]["micro"] == rec["micro"], b
        assert abs(got[b]["loss"] - rec["loss"]) < 1e-4, (b, got[b], rec)
        assert got[b]["target_rank"] == b % 2  # each rank ran the target on its own batch
    for mine, theirs in zip(read_jsonl(out / "metrics.jsonl"), read_jsonl(ref_out / "metrics.jsonl")):
        assert mine["step"] == theirs["step"] and abs(mine["loss"] - theirs["loss"]) < 1e-4
        assert mine["label_positions"] == theirs["label_positions"]
    # fused: the compiled graphs (components/fusion.py) were all made in the first window, none after
    graphs = [r["compiled_graphs"] for r in read_jsonl(out / "metrics.jsonl") if "compiled_graphs" in r]
    assert graphs and graphs[0] > 0 and set(graphs) == {graphs[0]}, graphs
    # Checkpoints and the export: the same shape and format, the same weights as the disaggregated run's.
    for step in (10, 20):
        state = json.loads((out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert (state["step"], state["num_drafters"], state["global_batch"], state["colocated"]) == (step, 2, 2, True)
    from dflash_ds.tools.ckpt import format_info
    from dflash_ds.runtime.resume import checkpoint_info

    info = checkpoint_info(out / "checkpoints" / "step_00000020")
    assert info["colocated"] and info["resume_on_drafters"]["2"] == "yes (shards as written)"
    assert "2 (colocated: each also ran the target; resumes either way)" in format_info(info)
    ref_ck = ref_out / "checkpoints" / "step_00000020" / "export"
    assert json.loads((out / "checkpoints/step_00000020/export/config.json").read_text()) == \
        json.loads((ref_ck / "config.json").read_text())
    mine, theirs = export_weights(out, 20), export_weights(ref_out, 20)
    assert mine.keys() == theirs.keys()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < 1e-5


def test_colocated_tensors_suit_the_gpu_groups(colocated):
    out, _ = colocated
    reports = {p.stem: json.loads(p.read_text()) for p in (out / "audit").glob("rank*.json")}
    assert sorted(reports) == ["rank0", "rank1"]
    for name, rep in reports.items():
        assert rep["emulated_backend"] == "nccl" and rep["violations"] == [], (name, rep["violations"][:3])
        assert "bridge/dflash_ds" not in rep["calls"]  # nothing crosses a bridge
        assert rep["calls"].get("role/dflash_ds", 0) >= 20 + 4, rep["calls"]  # per-step flags + metric windows


def test_colocated_resume_under_the_deepspeed_launcher_is_bit_exact(setup, colocated, tmp_path):
    """The step-10 checkpoint, resumed by `deepspeed --hostfile` on 2 colocated ranks with the first run's compile
    cache: steps 10-19 and the step-20 export equal the uninterrupted colocated run's exactly."""
    out, _ = colocated
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000010", ckpts / "step_00000010")
    (ckpts / "latest").write_text("step_00000010\n")
    # what the first run compiled (train.compile_cache; runtime/compile_cache.py), loaded by both ranks at start
    index = json.loads((out / "compile_cache" / "index.json").read_text())
    keys = {k for ks in index.values() for k in ks}
    assert any(k.startswith("inductor/") for k in keys) and len(keys) >= 7, index  # the fused graphs, fwd + bwd
    shutil.copytree(out / "compile_cache", run / "compile_cache")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
           "--node_rank", "0", "--num_nodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "--module", "dflash_ds.train", *args_for(setup, run, "--resume", "auto", *FUSED)]
    r = run_bounded(cmd, 360, env=env_for_children(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "resuming from" in r.stdout and "step_00000010 at step 10" in r.stdout, r.stdout[-2000:]
    assert f"compile cache: {len(keys)} compiled artifact(s) loaded" in r.stdout, r.stdout[-2000:]
    got, want = per_batch(run), per_batch(out)
    assert sorted(got) == [b for b in sorted(want) if want[b]["step"] >= 10]
    for b, rec in got.items():
        assert (rec["step"], rec["loss"]) == (want[b]["step"], want[b]["loss"]), b  # bit for bit
    mine, theirs = export_weights(run, 20), export_weights(out, 20)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_one_colocated_rank_sigterm_resume_export_eval(setup, reference, tmp_path):
    """One rank (--nproc_per_node 1) accumulating the reference's global batch of 2, with the target forward
    overlapped on a side thread: SIGTERM at step 7 -> checkpoint step 8, exit 75; --resume auto -> the
    reference's 40 batches at the reference's steps, losses within 1e-4; the export evaluates losslessly."""
    from dflash_ds.cli import main

    ref_out, _ = reference
    target, data = setup
    extra = ["--global-batch", "2", "--topology.colocate_overlap", "true"]
    r1 = torchrun(1, args_for(setup, tmp_path, *extra), env={"DFLASH_FAULT_RANK": "0", "DFLASH_FAULT_TERM_AT": "7"},
                  timeout=300, cwd=tmp_path)
    assert torchrun_exit_codes(r1.stderr) == {0: 75}, r1.stdout[-2000:] + r1.stderr[-4000:]  # its one rank
    assert "stop requested (SIGTERM on rank 0): checkpoint at step 8" in r1.stdout, r1.stdout[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    r2 = torchrun(1, args_for(setup, tmp_path, "--resume", "auto", "--topology.colocate_overlap", "true"),
                  timeout=300, cwd=tmp_path)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-4000:]
    assert "1 colocated rank(s)" in r2.stdout and "global batch 2 = 1 x 2" in r2.stdout
    got, want = per_batch(tmp_path), per_batch(ref_out)
    assert sorted(got) == sorted(want)
    for b, rec in want.items():
        assert (got[b]["step"], got[b]["micro"]) == (rec["step"], b % 2), b
        assert abs(got[b]["loss"] - rec["loss"]) < 1e-4, (b, got[b], rec)
    export = tmp_path / "checkpoints" / "step_00000020" / "export"
    result = tmp_path / "eval.json"
    assert main(["eval", "--target", str(target), "--drafter", str(export), "--data", str(data), "--num-prompts", "2",
                 "--max-new-tokens", "8", "--json", str(result), "--device", "cpu"]) == 0
    res = json.loads(result.read_text())
    assert res["lossless_checked"] and res["mismatches"] == [] and res["num_prompts"] == 2


def test_disaggregated_checkpoint_resumes_colocated_and_a_lost_rank_is_named(setup, reference, tmp_path):
    """The reference's (1 target + 2 drafters) step-10 checkpoint resumes on 2 colocated ranks: steps 10-13
    train the reference's batches (losses within 1e-4); rank 1 is then SIGKILLed at step 14 and rank 0
    names it and exits non-zero within 2 heartbeats of the kill."""
    ref_out, _ = reference
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copytree(ref_out / "checkpoints" / "step_00000010", ckpts / "step_00000010")
    (ckpts / "latest").write_text("step_00000010\n")
    heartbeat_s = 10
    (tmp_path / "status").mkdir()
    r = torchrun(2, args_for(setup, tmp_path, "--train.timeout_s", "20", "--train.heartbeat_timeout_s",
                             str(heartbeat_s)),
                 env={"DFLASH_FAULT_RANK": "1", "DFLASH_FAULT_KILL_AT": "14",
                      "DFLASH_EXIT_STATUS_DIR": str(tmp_path / "status")}, timeout=300, cwd=tmp_path)
    assert r.returncode != 0
    assert "lost rank 1 (colocated 1)" in r.stderr, r.stderr[-4000:]
    got = exit_statuses(tmp_path / "status")
    assert got[1]["status"] == -9 and got[0]["status"] != 0, got
    took = round(got[0]["time"] - got[1]["time"], 1)  # from the kill to rank 0's exit
    print(f"colocated rank 1 killed: rank 0 exited {got[0]['status']} {took} s later (heartbeat {heartbeat_s} s)")
    assert took <= 2 * heartbeat_s, (took, r.stderr[-4000:])
    got, want = per_batch(tmp_path), per_batch(ref_out)
    trained = [b for b in sorted(want) if 10 <= want[b]["step"] < 14]
    assert sorted(got) == trained == list(range(20, 28)), sorted(got)  # nothing of step 14 was recorded
    for b in trained:
        assert got[b]["step"] == want[b]["step"] and abs(got[b]["loss"] - want[b]["loss"]) < 1e-4, b
