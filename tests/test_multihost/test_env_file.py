"""The env file launch/train_deepspeed.sh hands the deepspeed launcher (`python -m dflash_ds.distributed.hostfile
env-file`): the user's .deepspeed_env lines first and unchanged, then the job's variables it does not set."""

from __future__ import annotations

import os
import subprocess
import sys


def test_env_file_keeps_the_users_lines_and_adds_the_jobs(tmp_path):
    user = tmp_path / ".deepspeed_env"
    user.write_text("HF_HOME=/shared/hf\nNCCL_IB_HCA=mlx5_0\n")
    env = {"PATH": "/venv/bin:/usr/bin", "HF_HOME": "/home/me/hf", "WANDB_PROJECT": "p", "HOME": str(tmp_path),
           "GLOO_SOCKET_IFNAME": "eth1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "SECRET_UNRELATED": "x", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "dflash_ds.distributed.hostfile", "env-file", str(tmp_path / "out")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out").read_text().splitlines() == [
        "HF_HOME=/shared/hf", "NCCL_IB_HCA=mlx5_0",  # the user's, as written (their HF_HOME wins)
        "GLOO_SOCKET_IFNAME=eth1", "PATH=/venv/bin:/usr/bin", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "WANDB_PROJECT=p"]
    assert user.read_text() == "HF_HOME=/shared/hf\nNCCL_IB_HCA=mlx5_0\n"
