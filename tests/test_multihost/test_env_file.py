"""The env file launch/train_deepspeed.sh hands the deepspeed launcher (`python -m dflash_ds.distributed.hostfile
env-file`): the user's .deepspeed_env lines first and unchanged, then the job's variables it does not set; the one
secret-name rule it filters by (distributed/credentials.py) and the log filter (redact.py)."""

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
    learns which names to unset and which paths to export. TOKENIZERS_PARALLELISM and a path (HF_TOKEN_PATH-like) are no secrets."""
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
    assert r.stdout.strip() == (f"unset HF_TOKEN MLFLOW_TRACKING_TOKEN WANDB_API_KEY; "
                                f"export HF_TOKEN_PATH={creds / 'hf_token'}; "
                                f"export DFLASH_SECRETS_FILE={creds / 'secrets.env'}")
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


def test_one_secret_name_rule():
    """credentials.is_secret_name: TOKEN, KEY, SECRET, PASSWORD, CREDENTIAL, AUTH anywhere, any case, less the
    allowlist; no config field is a secret (scrub_secrets would hide it in saved configs)."""
    from dflash_ds.config import field_docs
    from dflash_ds.distributed.credentials import is_secret_name

    secret = ["HF_TOKEN", "HF_HUB_TOKEN_X", "WANDB_KEY", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "db_password",
              "AWS_SECRET_ACCESS_KEY", "GCP_CREDENTIALS", "PROXY_AUTH", "NCCL_IB_PKEY", "--api-key", "wandb.api_key",
              "hub.hf_token", "token", "Authorization"]
    plain = ["TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH", "GOOGLE_APPLICATION_CREDENTIALS_FILE",
             "DFLASH_CREDENTIALS_DIR", "SSH_AUTH_SOCK", "DFLASH_SECRETS_FILE", "--max-new-tokens",
             "embed_tokens.weight", "tokenizer", "data.token_budget", "model.mask_token_id", "num_key_value_heads",
             "PATH", "MASTER_ADDR"]
    assert [n for n in secret if not is_secret_name(n)] == [] and [n for n in plain if is_secret_name(n)] == []
    assert [k for k in field_docs() if is_secret_name(k)] == []


def test_a_url_that_carries_its_password_is_a_secret_whatever_its_name(tmp_path):
    """MLFLOW_TRACKING_URI (DeepSpeed forwards MLFLOW_* by value), a proxy and a package index with user:password@
    in the URL, one of them in the user's .deepspeed_env: none reaches the env file, each goes by path and is
    unset; a URL without a password (a proxy's host:port) stays."""
    from dflash_ds.distributed.credentials import is_secret

    assert is_secret("HTTPS_PROXY", "http://me:pw_SENTINEL_7@proxy:3128")
    assert not is_secret("HTTPS_PROXY", "http://proxy:3128") and not is_secret("X", "a:b@c, user@host:22")
    (tmp_path / ".deepspeed_env").write_text("PIP_INDEX_URL=https://ci:pw_SENTINEL_8@pypi.example/simple\n")
    env = {"PATH": "/usr/bin", "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": "https://me:pw_SENTINEL_9@ml.example",
           "HTTPS_PROXY": "http://me:pw_SENTINEL_7@proxy:3128", "HTTP_PROXY": "http://proxy:3128",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    creds = tmp_path / "creds"
    r = subprocess.run([sys.executable, "-m", "dflash_ds.distributed.hostfile", "env-file", str(tmp_path / "out"),
                        "--credentials-dir", str(creds)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("unset HTTPS_PROXY MLFLOW_TRACKING_URI; export DFLASH_SECRETS_FILE="), r.stdout
    assert "SENTINEL" not in (tmp_path / "out").read_text() + r.stdout + r.stderr
    assert (creds / "secrets.env").read_text() == (
        "HTTPS_PROXY=http://me:pw_SENTINEL_7@proxy:3128\nMLFLOW_TRACKING_URI=https://me:pw_SENTINEL_9@ml.example\n"
        "PIP_INDEX_URL=https://ci:pw_SENTINEL_8@pypi.example/simple\n")


def test_logs_show_secrets_as_stars():
    """dflash_ds/redact.py: the environment's secret values anywhere, and the value after a secret name in every
    form a log shows one (bare, quoted, flag, JSON, YAML, a Python dict, a URL's password, a Bearer header)."""
    from dflash_ds.redact import redact, redact_argv

    env = {"HF_TOKEN": "hf_SENTINEL_1", "TOKENIZERS_PARALLELISM": "false", "X": "1", "AUTH_MODE": "none"}
    line = ("pdsh -w h0,h1 export HF_TOKEN=hf_SENTINEL_1; export WANDB_API_KEY=wb_other; cd /r; python -m t "
            "--hf-token hf_SENTINEL_1 --data.token_budget 1024 --x.client_secret=abc TOKENIZERS_PARALLELISM=false")
    assert redact(line, env) == ("pdsh -w h0,h1 export HF_TOKEN=***; export WANDB_API_KEY=***; cd /r; python -m t "
                                 "--hf-token *** --data.token_budget 1024 --x.client_secret=*** "
                                 "TOKENIZERS_PARALLELISM=false")
    assert redact_argv(["--wandb-api-key", "k", "--max-steps", "5", "in hf_SENTINEL_1"], env) == \
        ["--wandb-api-key", "***", "--max-steps", "5", "in ***"]
    forms = {
        'export WANDB_API_KEY="a b"; HF_HUB_TOKEN_X=\'c\' run':
            'export WANDB_API_KEY="***"; HF_HUB_TOKEN_X=\'***\' run',
        "serve --api-key 'k y' --port 8000": "serve --api-key '***' --port 8000",
        '{"api_key": "s\\"x", "token_budget": 1024, "hf_token": null}':
            '{"api_key": "***", "token_budget": 1024, "hf_token": null}',
        "{'hf_token': 'hf_x', 'n': 1}": "{'hf_token': '***', 'n': 1}",
        "wandb:\n  api_key: abc\n  - token: t1\nmask_token_id: 5\nx: {password: pw, n: 2}":
            "wandb:\n  api_key: ***\n  - token: ***\nmask_token_id: 5\nx: {password: ***, n: 2}",
        "fetch https://user:pw9@host:443/x from http://host:80/y":
            "fetch https://user:***@host:443/x from http://host:80/y",
        "Authorization: Bearer abcdefgh123": "Authorization: Bearer ***",
        "ssh -o PasswordAuthentication=no h0": "ssh -o PasswordAuthentication=no h0",
        "a config key: none, embed_tokens.weight: a.embed_tokens.weight": "a config key: none, embed_tokens.weight: "
                                                                          "a.embed_tokens.weight",
    }
    assert {text: redact(text, env) for text in forms} == forms


def test_env_file_values_arrive_intact_and_a_users_ds_env_file_is_filtered(tmp_path):
    """A value with a space, `;` and `$(touch X)`, in a variable of the env file or one DeepSpeed forwards itself
    (MLFLOW_*), goes through DeepSpeed's export line (its add_export, then the remote shell) intact and X is not
    created; a user's DS_ENV_FILE loses its secrets (to the credentials folder, unquoted as the shell would read
    them) like .deepspeed_env, and HF_HUB_TOKEN_X and WANDB_KEY go by path."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    marker = tmp_path / "pwned"
    tricky = f"a b; $(touch {marker}) `touch {marker}` \\ \"q\" 'p' $HOME"
    (tmp_path / "my.env").write_text('NCCL_IB_HCA=mlx5_0\nMLFLOW_TRACKING_TOKEN="ml_SENTINEL_4"\n')
    env = {"PATH": "/usr/bin", "HOME": str(tmp_path), "WANDB_NAME": tricky, "MLFLOW_RUN_NAME": tricky,
           "HF_HUB_TOKEN_X": "hf_SENTINEL_5", "WANDB_KEY": "wb_SENTINEL_6",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    creds = tmp_path / "creds"
    r = subprocess.run([sys.executable, "-m", "dflash_ds.distributed.hostfile", "env-file", str(tmp_path / "out"),
                        "--credentials-dir", str(creds), "--user-env-file", "my.env"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("unset HF_HUB_TOKEN_X WANDB_KEY; export DFLASH_SECRETS_FILE=")
    text = (tmp_path / "out").read_text()
    assert "SENTINEL" not in text and text.startswith("NCCL_IB_HCA=mlx5_0\n")
    assert (creds / "secrets.env").read_text() == \
        "HF_HUB_TOKEN_X=hf_SENTINEL_5\nMLFLOW_TRACKING_TOKEN=ml_SENTINEL_4\nWANDB_KEY=wb_SENTINEL_6\n"
    # As deepspeed/launcher/runner.py forwards: its own prefixes from its (secret-free) environment, then the file's
    # lines, which replace them; then PDSHRunner.get_cmd's `export K=V; ` line for the remote shell.
    runner = type("Runner", (), {"exports": {}})()
    MultiNodeRunner.add_export(runner, "MLFLOW_RUN_NAME", tricky)  # by its MLFLOW prefix
    for line in text.splitlines(keepends=True):
        MultiNodeRunner.add_export(runner, *line.split("=", 1))
    exports = "".join(f"export {k}={v}; " for k, v in runner.exports.items())
    got = subprocess.run(["bash", "-c", exports + 'printf "%s|%s" "$WANDB_NAME" "$MLFLOW_RUN_NAME"'],
                         capture_output=True, text=True, timeout=30, env={"HOME": "/elsewhere"})
    assert got.stdout == f"{tricky}|{tricky}" and not marker.exists(), got


STUB = """\
import json, os, signal, stat, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(76))  # before the record: the test signals once it is there
env_file = os.environ["DS_ENV_FILE"]
creds = {k: v for k, v in (line.split("=", 1) for line in open(env_file).read().splitlines())
         if k in ("HF_TOKEN_PATH", "DFLASH_SECRETS_FILE")}
secret_env = sorted(k for k in os.environ if "SENTINEL" in os.environ[k] and k != "STUB_ECHO")
assert all(os.environ[k] == v for k, v in creds.items()), "the launcher has the paths too (a single host's ranks)"
record = {"argv": sys.argv[1:], "secret_env": secret_env,
           "env_file": open(env_file).read(), "env_mode": stat.S_IMODE(os.stat(env_file).st_mode),
           "modes": {k: stat.S_IMODE(os.stat(v).st_mode) for k, v in creds.items()},
           "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(creds["HF_TOKEN_PATH"])).st_mode),
           "files": [env_file, os.path.dirname(creds["HF_TOKEN_PATH"]), os.environ["DFLASH_STOP_FILE"]],
           "stop_file_forwarded": f"DFLASH_STOP_FILE={os.environ['DFLASH_STOP_FILE']}" in open(env_file).read()}
with open(os.environ["STUB_OUT"] + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(os.environ["STUB_OUT"] + ".tmp", os.environ["STUB_OUT"])  # read whole or not at all
print("launcher: --hf-token", os.environ.get("STUB_ECHO", ""), flush=True)
deadline = time.monotonic() + float(os.environ["STUB_SLEEP"])
while time.monotonic() < deadline:  # as global rank 0 does: the stop file is a SIGTERM to the job (exit 75)
    if os.environ.get("STUB_OBEY_STOP") == "1" and os.path.exists(os.environ["DFLASH_STOP_FILE"]):
        sys.exit(75)
    time.sleep(0.05)
sys.exit(3)
"""


def test_launch_script_writes_no_secret_removes_its_files_and_passes_signals_on(tmp_path):
    """launch/train_deepspeed.sh over ssh with a stub launcher: the launcher sees no secret in its environment, its
    arguments or the env file (0600), the credentials are files of mode 0600 in a 0700 folder; its output shows a
    secret as ***; its status is the script's. A SIGTERM to the script does not reach the launcher (the deepspeed
    runner would kill every rank before a checkpoint): it creates DFLASH_STOP_FILE, forwarded to every host by the
    env file, which the job's rank 0 turns into the job-wide stop (75 back); a second SIGTERM goes to the launcher.
    On every exit the env file, the credentials and the stop file are gone."""
    import json
    import signal
    import time
    from pathlib import Path

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(f"#!{sys.executable}\n{STUB}")
    (bin_dir / "deepspeed").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    (tmp_path / "hostfile").write_text("h0 slots=1\nh1 slots=1\n")
    repo = Path(__file__).resolve().parents[2]
    sentinel = "hf_SENTINEL_launch"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(repo), "HOSTFILE": str(tmp_path / "hostfile"), "TMPDIR": str(tmp_path),
           "HF_TOKEN": sentinel, "WANDB_API_KEY": "wb_SENTINEL_launch", "STUB_OUT": str(tmp_path / "stub.json"),
           "STUB_ECHO": sentinel}
    script = ["bash", str(repo / "launch/train_deepspeed.sh"), "--max-steps", "5"]
    r = subprocess.run(script, env={**env, "STUB_SLEEP": "0"}, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 3, r.stderr
    seen = json.loads((tmp_path / "stub.json").read_text())
    assert seen["argv"][-2:] == ["--max-steps", "5"] and seen["secret_env"] == []
    assert "SENTINEL" not in seen["env_file"] and seen["env_mode"] == 0o600 and seen["dir_mode"] == 0o700
    assert seen["modes"] == {"HF_TOKEN_PATH": 0o600, "DFLASH_SECRETS_FILE": 0o600}
    assert "launcher: --hf-token ***" in r.stdout and "SENTINEL" not in r.stdout + r.stderr
    assert not any(os.path.exists(f) for f in seen["files"])
    assert seen["stop_file_forwarded"] and not os.path.exists(seen["files"][2])
    for obey, signals, status in (("1", 1, 75), ("0", 2, 76)):  # the stop honoured; a second SIGTERM: the hard stop
        (tmp_path / "stub.json").unlink()
        proc = subprocess.Popen(script, env={**env, "STUB_SLEEP": "60", "STUB_OBEY_STOP": obey}, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (tmp_path / "stub.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        files = json.loads((tmp_path / "stub.json").read_text())["files"]
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        assert proc.wait(timeout=30) == status
        assert "asked the job to stop (checkpoint, exit 75)" in proc.stderr.read()
        assert not any(os.path.exists(f) for f in files)
