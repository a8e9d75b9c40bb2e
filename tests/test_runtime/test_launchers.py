"""Launch paths (two torchrun agents on one host) and the errors caught before any model loads.

The deepspeed launcher over ssh and pdsh on two hosts is test_multihost_train.py's (it replaced a --no_ssh run here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proc_utils import process_group
from runtime_utils import REPO, env_for_children, free_port, read_jsonl, torchrun

SHORT = ["--config", str(REPO / "configs/tiny.yaml"), "--max-steps", "3", "--train.log_interval", "1",
         "--data.token_budget", "1024", "--train.timeout_s", "90", "--no-wandb"]


def test_two_torchrun_agents_nnodes_2(setup, tmp_path):
    """Two agents with c10d rendezvous on localhost: 2 nodes x 3 ranks, one target per node feeding the
    two drafters of its node (T = 2, D = 4: a global rule g mod T would send half the batches across)."""
    target, data = setup
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "3",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "t",
           "--master_port", str(port), "-m", "dflash_ds.train", *SHORT, "--target", str(target),
           "--data", str(data), "--output-dir", str(tmp_path), "--targets-per-node", "1"]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(), cwd=tmp_path)
    with process_group(cmd, **kw) as a0, process_group(cmd, **kw) as a1:
        agents = [a0, a1]
        outs = [a.communicate(timeout=360) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, out[-2000:] + err[-4000:]
    text = "".join(o for o, _ in outs)
    assert "6 ranks: targets [2, 5], drafters [0, 1, 3, 4]; routed within each node" in text
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    # Every batch came from the target of the drafter's own node (drafters 0, 1 and target 2 on node 0).
    for d, rank in enumerate([0, 1, 3, 4]):
        records = read_jsonl(tmp_path / "records" / f"drafter{d}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        assert {r["target_rank"] for r in records} == {2 if rank < 3 else 5}


@pytest.mark.parametrize("extra, message", [
    (["--num-target-ranks", "5"], "--num-target-ranks 5 leaves 0 drafter ranks in a world of 3"),
    (["--ds-config", "/nonexistent/zero.json"], "--ds-config /nonexistent/zero.json does not exist"),
    (["--colocate", "--targets-per-node", "1"], "--colocate runs the target on every rank"),
    (["--train.dtype", "bf16", "--zero-stage", "0"], "ZeRO stage 0 with bf16 would accumulate gradients"),
])
def test_bad_layout_or_ds_config_is_one_error(setup, tmp_path, extra, message):
    """What every rank checks before any group or model (`validate_job`), in process."""
    from dflash_ds.errors import DFlashError
    from dflash_ds.runtime.launch import validate_job
    from dflash_ds.train import config_from_args

    target, data = setup
    with pytest.raises(DFlashError) as err:
        validate_job(config_from_args([*SHORT, "--target", str(target), "--data", str(data), *extra]), 3, 3)
    assert message in str(err.value)


def test_bad_layout_fails_on_every_rank_before_loading(setup, tmp_path):
    target, data = setup
    message = "--num-target-ranks 3 leaves 0 drafter ranks in a world of 3"
    r = torchrun(3, [*SHORT, "--target", str(target), "--data", str(data), "--output-dir", str(tmp_path),
                     "--num-target-ranks", "3"], timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "dflash-ds train (rank" in line]
    assert errors and all(message in line for line in errors), r.stderr[-3000:]
    assert "Loading weights" not in r.stderr + r.stdout  # no model was loaded
    assert not (tmp_path / "checkpoints").exists()
