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


def test_secrets_reach_the_env_file_only_by_path(tmp_path):
    """HF_TOKEN, WANDB_API_KEY, an MLFLOW_TRACKING_TOKEN and a secret line of the user's .deepspeed_env: none in the
    env file (mode 0600), each in a 0600 file of the 0700 credentials folder, named there by path; the script
    learns which names to unset. TOKENIZERS_PARALLELISM and a path (HF_TOKEN_PATH-like) are no secrets."""
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5_0\nDB_PASSWORD=pw-from-file\n")
    env = {"PATH": "/usr/bin", "HOME": str(tmp_path), "HF_TOKEN": "hf_SENTINEL_1", "WANDB_API_KEY": "wb_SENTINEL_2",
           "MLFLOW_TRACKING_TOKEN": "ml_SENTINEL_3", "WANDB_PROJECT": "p", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o755)
    r = subprocess.run([sys.executable, "-m", "dflash_ds.distributed.hostfile", "env-file", str(tmp_path / "out"),
                        "--credentials-dir", str(creds)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["HF_TOKEN", "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"]
    text = (tmp_path / "out").read_text()
    assert "SENTINEL" not in text and "pw-from-file" not in text and "SENTINEL" not in r.stdout + r.stderr
    assert text.splitlines() == [
        "NCCL_IB_HCA=mlx5_0", "PATH=/usr/bin", "TOKENIZERS_PARALLELISM=false", "WANDB_PROJECT=p",
        f"HF_TOKEN_PATH={creds / 'hf_token'}", f"DFLASH_SECRETS_FILE={creds / 'secrets.env'}"]
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o600 and creds.stat().st_mode & 0o777 == 0o700
    assert (creds / "hf_token").read_text() == "hf_SENTINEL_1"
    assert (creds / "secrets.env").read_text() == \
        "DB_PASSWORD=pw-from-file\nMLFLOW_TRACKING_TOKEN=ml_SENTINEL_3\nWANDB_API_KEY=wb_SENTINEL_2\n"
    assert {p.name: p.stat().st_mode & 0o777 for p in creds.iterdir()} == {"hf_token": 0o600, "secrets.env": 0o600}
    # A rank loads the rest into its environment as it starts; what it already has wins.
    from dflash_ds.distributed.credentials import load_secrets_file

    rank_env = {"DFLASH_SECRETS_FILE": str(creds / "secrets.env"), "DB_PASSWORD": "mine"}
    assert load_secrets_file(rank_env) == ["MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"]
    assert rank_env["WANDB_API_KEY"] == "wb_SENTINEL_2" and rank_env["DB_PASSWORD"] == "mine"


def test_logs_show_secrets_as_stars():
    """dflash_ds/redact.py: the environment's secret values anywhere, and secret NAME=VALUE / --flag VALUE."""
    from dflash_ds.redact import redact, redact_argv

    env = {"HF_TOKEN": "hf_SENTINEL_1", "TOKENIZERS_PARALLELISM": "false", "X": "1"}
    line = ("pdsh -w h0,h1 export HF_TOKEN=hf_SENTINEL_1; export WANDB_API_KEY=wb_other; cd /r; python -m t "
            "--hf-token hf_SENTINEL_1 --data.token_budget 1024 --x.client_secret=abc TOKENIZERS_PARALLELISM=false")
    assert redact(line, env) == ("pdsh -w h0,h1 export HF_TOKEN=***; export WANDB_API_KEY=***; cd /r; python -m t "
                                 "--hf-token *** --data.token_budget 1024 --x.client_secret=*** "
                                 "TOKENIZERS_PARALLELISM=false")
    assert redact_argv(["--wandb-api-key", "k", "--max-steps", "5", "in hf_SENTINEL_1"], env) == \
        ["--wandb-api-key", "***", "--max-steps", "5", "in ***"]
