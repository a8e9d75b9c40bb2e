"""No command injection across hosts through the variables the deepspeed launcher carries (issue 58, point 1).

On two hosts (tests/hosts.py), launched as launch/train_deepspeed.sh does: `python -m dflash_ds.distributed.hostfile
env-file` writes the env file and the secrets, then DeepSpeed's own runner (`python -m deepspeed.launcher.runner`)
reads that file, builds pdsh's `export K=V; ...` line and starts a rank on each host through pdsh and ssh. Every
printable or non-ASCII value (quotes, backslashes, `;`, `$()`, backquotes, pdsh's own `%h`) reaches the rank on
h1 byte for byte; every line break or control character is refused, naming the variable, before it can reach
DeepSpeed's reader (universal newlines: after a `\\r` the rest of a value was an unquoted `export` line, a
command on every host).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dflash_ds.distributed.credentials import write_credentials
from dflash_ds.distributed.hostfile import deepspeed_env_text
from dflash_ds.errors import DFlashError

REPO = Path(__file__).resolve().parents[2]

# Every character str.splitlines or DeepSpeed's universal newlines break on, then other controls (tab, ESC, DEL,
# a C1 CSI) and bytes that are not UTF-8 (as os.environ holds them: a lone surrogate).
BAD_CHARS = ["\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\t", "\x1b", "\x7f",
             "\x9b", "\udcff"]


def accepted_values(marker: Path) -> dict[str, str]:
    """Values that must arrive as they are; each would create `marker`* if a shell ran any part of it."""
    return {
        "QUOTES": """it's "double" and 'single'""",
        "WRAPPED": '"wrapped in its own quotes"',
        "BACKSLASHES": "a\\b \\\\ \\n \\$HOME \\",
        "SEMICOLONS": f"a; touch {marker}-semi; b;",
        "SUBST": f"$(touch {marker}-subst) ${{HOME}} $HOME $((6*7))",
        "BACKTICKS": f"`touch {marker}-tick` ``",
        "NON_ASCII": "héllo wörld – 日本語 🚀 \u00a0nbsp \u200bzw \ufeffbom",
        "PERCENT": "50% %h %u %n %% %",
        "SHELL": "a|b && c > d < e * ? [x] ~ # {a,b} !x -- = '",
    }


RANK = """\
import json, os, socket, sys
from dflash_ds.distributed.credentials import load_secrets_file
try:  # as dflash_ds.runtime.launch.run_job does first on every rank
    loaded, error = load_secrets_file(), None
except Exception as exc:
    loaded, error = [], f"{type(exc).__name__}: {exc}"
env = {k.decode("latin-1"): v.hex() for k, v in os.environb.items()
       if k.startswith((b"WANDB_", b"MLFLOW_V_", b"MLFLOW_TRACKING_TOKEN", b"DFLASH_X"))}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"host": socket.gethostname(), "env": env, "loaded": sorted(loaded), "error": error}, f)
"""


def test_values_reach_the_other_host_byte_for_byte_and_control_characters_are_refused(hosts, tmp_path):
    """The rank on h1 holds every accepted value byte for byte (a variable of the env file, one the launcher
    forwards itself, a secret loaded from secrets.env, a user's `export` line); every bad character is refused
    with the variable named, and no marker file appears."""
    marker = tmp_path / "pwned"
    values = accepted_values(marker)
    # The job's variables (WANDB_*: by the env file; MLFLOW_*: forwarded by the deepspeed launcher itself, then
    # replaced by the env file's escaped line), and secrets (by path: secrets.env, loaded by each rank).
    plain = {f"{prefix}{k}": v for k, v in values.items() for prefix in ("WANDB_V_", "MLFLOW_V_")}
    secrets = {"WANDB_API_KEY": f" {values['SUBST']} {values['QUOTES']} ",  # blanks at the ends too
               "MLFLOW_TRACKING_TOKEN": values["WRAPPED"], "WANDB_X_TOKEN": values["NON_ASCII"] + values["PERCENT"]}
    # A user's .deepspeed_env in shell style: `export ` lines, a comment, one secret.
    (tmp_path / ".deepspeed_env").write_text("# mine\nexport WANDB_ENTITY=team-é\nexport WANDB_KEY='wb user'\n")
    # Each bad character, in the shape of the reproduced attack, as a variable of the env file and as a secret:
    # each must be refused. One that is not (the fix undone) goes into the files below all the same, so that the
    # launch shows what it would do on the hosts.
    refused: dict[str, list[str]] = {"env": [], "secrets": []}
    leaked_env, leaked_secrets = "", ""
    for i, ch in enumerate(BAD_CHARS):
        name = f"WANDB_BAD_{i}"
        try:
            text = deepspeed_env_text({name: f"run-1{ch}X;touch {marker}-{i};Y=1"}, [])
            text.encode()  # what cannot be written would have crashed the launch instead
            leaked_env += text
        except DFlashError as exc:
            if str(exc).startswith(f"{name}: ") and "touch" not in str(exc):
                refused["env"].append(ascii(ch))
        except UnicodeError:  # a crash is not the one clear error, nor an injection
            pass
        name = f"WANDB_API_KEY_{i}"
        try:
            forward = write_credentials(tmp_path / f"bad{i}", {name: f"wb{ch}DFLASH_X_{i}=evil"})
            leaked_secrets += Path(forward.get("DFLASH_SECRETS_FILE", os.devnull)).read_text()
        except DFlashError as exc:
            if str(exc).startswith(f"{name}: ") and "evil" not in str(exc):
                refused["secrets"].append(ascii(ch))
        except UnicodeError:
            pass
    (tmp_path / "leaked.env").write_text(leaked_env)
    (tmp_path / "leaked-secrets.env").write_text(leaked_secrets)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "hostfile").write_text("h1 slots=1\n")  # the launcher on h0, the rank on h1 (--force_multi: by pdsh)
    (tmp_path / "out").mkdir()
    env = hosts.env({"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                     "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", **plain, **secrets})
    # launch/train_deepspeed.sh's steps, less its output filter and signal handling.
    script = ('set -euo pipefail; export DS_ENV_FILE="$PWD/ds.env"; mkdir -m 700 creds\n'
              'SETUP=$(python -m dflash_ds.distributed.hostfile env-file "$DS_ENV_FILE" --credentials-dir creds)\n'
              'eval "$SETUP"; cat leaked.env >> "$DS_ENV_FILE"; cat leaked-secrets.env >> "$DFLASH_SECRETS_FILE"\n'
              'python -m deepspeed.launcher.runner --hostfile hostfile --force_multi --master_port 29500 '
              '--no_local_rank rank.py "$PWD/out"')
    r = hosts.run("h0", ["bash", "-c", script], cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = {rec["host"]: rec for rec in (json.loads(p.read_text()) for p in (tmp_path / "out").iterdir())}
    expected_env = {**{k: v.encode().hex() for k, v in {**plain, **secrets}.items()},
                    "WANDB_ENTITY": "team-é".encode().hex(), "WANDB_KEY": b"wb user".hex()}
    loaded = sorted([*secrets, "WANDB_KEY"])
    assert {
        "refused": refused,
        "markers": sorted(p.name for p in tmp_path.glob("pwned*")),
        "ranks": {h: {k: ranks[h][k] for k in ("env", "loaded", "error")} for h in ranks},
    } == {
        "refused": {"env": [ascii(c) for c in BAD_CHARS], "secrets": [ascii(c) for c in BAD_CHARS]},
        "markers": [],
        "ranks": {"h1": {"env": expected_env, "loaded": loaded, "error": None}},
    }
    # pdsh's command line (`ps` on every host, DeepSpeed's log) holds no secret: they went by path.
    assert not any(v in r.stdout + r.stderr for v in secrets.values() if len(v) > 8)
    assert "export WANDB_V_SUBST=" in r.stdout + r.stderr  # DeepSpeed logged its command: the file was read
