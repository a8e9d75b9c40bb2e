"""What the `NAME=value` files that carry variables to other hosts may hold (issue 58, point 1): the deepspeed
launcher's env file (distributed/hostfile.py) and secrets.env (distributed/credentials.py). Any printable or
non-ASCII value round-trips; a line break or any other control character is one error naming the variable (and
the file's line), never printing the value. On real hosts, through DeepSpeed's runner and pdsh:
test_env_injection.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ds.distributed.credentials import load_secrets_file, write_credentials
from dflash_ds.distributed.hostfile import deepspeed_env_text, ds_env_value, parse_hostfile, secret_variables
from dflash_ds.errors import DFlashError

from test_env_injection import BAD_CHARS

DESCRIBED = {"\n": "a newline (\\n, U+000A)", "\r": "a carriage return (\\r, U+000D)",
             "\v": "a vertical tab (\\x0b, U+000B)", "\f": "a form feed (\\x0c, U+000C)",
             "\x1c": "a control character (\\x1c, U+001C)", "\x1d": "a control character (\\x1d, U+001D)",
             "\x1e": "a control character (\\x1e, U+001E)", "\x85": "a next-line character (\\x85, U+0085)",
             "\u2028": "a line separator (\\u2028, U+2028)", "\u2029": "a paragraph separator (\\u2029, U+2029)",
             "\t": "a tab (\\t, U+0009)", "\x1b": "a control character (\\x1b, U+001B)",
             "\x7f": "a control character (\\x7f, U+007F)", "\x9b": "a control character (\\x9b, U+009B)",
             "\udcff": "bytes that are not UTF-8 text"}


def _error(fn) -> str:
    """The DFlashError's message `fn()` raises ('accepted' when it raises none)."""
    try:
        fn()
    except DFlashError as exc:
        return str(exc)
    return "accepted"


def test_each_line_break_or_control_character_is_one_error_naming_the_variable(tmp_path):
    """In a variable of the env file, one the launcher forwards itself (MLFLOW_*), a line of the user's
    .deepspeed_env, a secret being written and a secrets file being read: each character, in the shape of the
    reproduced attacks (`run-1\\rX;touch M;Y=1`, `wb\\rDFLASH_X=evil`), is refused with the variable (and
    file:line) named and the value not shown; a secrets file that is refused sets nothing."""
    got, want = {}, {}
    for i, ch in enumerate(BAD_CHARS):
        attack, secret = f"run-1{ch}X;touch M;Y=1", f"wb{ch}DFLASH_X=evil"
        got[ascii(ch), "env"] = _error(lambda: deepspeed_env_text({"WANDB_NAME": attack}, []))
        got[ascii(ch), "launcher"] = _error(lambda: deepspeed_env_text({"MLFLOW_RUN_NAME": attack}, []))
        got[ascii(ch), "writer"] = _error(lambda: write_credentials(tmp_path / f"c{i}", {"WANDB_API_KEY": secret}))
        want[ascii(ch), "env"] = f"WANDB_NAME: its value holds {DESCRIBED[ch]}"
        want[ascii(ch), "launcher"] = f"MLFLOW_RUN_NAME: its value holds {DESCRIBED[ch]}"
        want[ascii(ch), "writer"] = f"WANDB_API_KEY: its value holds {DESCRIBED[ch]}"
        assert not (tmp_path / f"c{i}" / "secrets.env").exists()
        if ch in ("\n", "\udcff"):  # a file's own line end; no text file holds a lone surrogate
            continue
        user = tmp_path / f"user{i}.env"
        user.write_text(f"NCCL_IB_HCA=mlx5_0\nWANDB_NAME={attack}\n", newline="")
        got[ascii(ch), "user"] = _error(lambda: deepspeed_env_text({}, [user]))
        want[ascii(ch), "user"] = f"{user}:2: the value of WANDB_NAME holds {DESCRIBED[ch]}"
        secrets = tmp_path / f"secrets{i}.env"
        secrets.write_text(f"HF_HUB_TOKEN_X=hf\nWANDB_API_KEY={secret}\n", newline="")
        rank_env = {"DFLASH_SECRETS_FILE": str(secrets)}
        got[ascii(ch), "reader"] = _error(lambda: load_secrets_file(rank_env))
        want[ascii(ch), "reader"] = f"{secrets}:2: the value of WANDB_API_KEY holds {DESCRIBED[ch]}"
        assert rank_env == {"DFLASH_SECRETS_FILE": str(secrets)}, "nothing is set from a file that is refused"
    assert {k: v[:len(want[k])] for k, v in got.items()} == want
    assert not [v for v in got.values() if "touch" in v or "evil" in v]  # the value is never shown


# Printable and non-ASCII values that must come back as they are, quotes around the whole value included.
VALUES = ["""it's "double" and 'single'""", '"wrapped"', "'wrapped'", "''", '"', " blanks at the ends ",
          "a\\b \\\\ c\\", "a; b; $(touch M) `touch M` ${HOME}", "héllo 日本語 🚀 \u00a0 \u200b", "50% %h %n %%",
          "x=y=z", "#not a comment", "'it's'", "", "export X=1"]


def test_secrets_round_trip_byte_for_byte(tmp_path):
    """write_credentials then load_secrets_file (what a rank does): every value as it was."""
    secrets = {f"WANDB_API_KEY_{i}": v for i, v in enumerate(VALUES)}
    forward = write_credentials(tmp_path / "creds", secrets)
    rank_env = {"DFLASH_SECRETS_FILE": forward["DFLASH_SECRETS_FILE"]}
    assert sorted(load_secrets_file(rank_env)) == sorted(secrets)
    assert {k: rank_env[k] for k in secrets} == secrets


def test_a_secrets_file_written_by_hand(tmp_path):
    """`export ` lines (not a variable named `export WANDB_API_KEY`), comments, blank lines, CRLF line ends, a
    value in one pair of quotes; a multi-line secret pasted into the file (a PEM key) is an error at its second
    line that shows none of it, and sets nothing."""
    f = tmp_path / "secrets.env"
    f.write_text("# W&B\nexport WANDB_API_KEY=wb_1\r\n\n  export\tMLFLOW_TRACKING_TOKEN='ml 2'\nHF_X=\"q\"\n"
                 "DB_PASSWORD=a#b=c\n", newline="")
    rank_env = {"DFLASH_SECRETS_FILE": str(f)}
    assert load_secrets_file(rank_env) == ["WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "HF_X", "DB_PASSWORD"]
    assert [rank_env[k] for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "HF_X", "DB_PASSWORD")] == \
        ["wb_1", "ml 2", "q", "a#b=c"]
    f.write_text("WANDB_API_KEY=wb_1\nSSH_KEY=-----BEGIN KEY-----\nMIIEvQIBADANBgkq+hkiG9w0BAQE\n-----END KEY-----\n")
    rank_env = {"DFLASH_SECRETS_FILE": str(f)}
    message = _error(lambda: load_secrets_file(rank_env))
    assert message.startswith(f"{f}:3: not a NAME=value line") and "MIIE" not in message and "BEGIN" not in message
    assert rank_env == {"DFLASH_SECRETS_FILE": str(f)}
    f.write_text('WANDB_API_KEY="$(cat key)"\n')  # a shell would run it: this file is not read by one
    assert _error(lambda: load_secrets_file({"DFLASH_SECRETS_FILE": str(f)})).startswith(
        f"{f}:1: the value of WANDB_API_KEY is quoted with")


def test_export_lines_of_the_users_env_file(tmp_path):
    """A user's .deepspeed_env in shell style: `export` lines, a comment, CRLF; its secret goes to the secrets
    file under its own name, the rest into the env file as NAME=value (the value as written)."""
    user = tmp_path / ".deepspeed_env"
    user.write_text("# shared\r\nexport NCCL_IB_HCA=mlx5_0\r\nexport WANDB_API_KEY='wb 1'\n  export HF_HOME=/h\n",
                    newline="")
    secrets = secret_variables({}, [user])
    assert secrets == {"WANDB_API_KEY": "wb 1"}
    assert deepspeed_env_text({"WANDB_PROJECT": "p"}, [user]) == "NCCL_IB_HCA=mlx5_0\nHF_HOME=/h\nWANDB_PROJECT=p\n"
    user.write_text("NCCL_IB_HCA=mlx5_0\n#X=1\nA;touch M=1\n")  # DeepSpeed would run `export A;touch M=1;`
    assert _error(lambda: deepspeed_env_text({}, [user])).startswith(f"{user}:3: not a NAME=value line")


def test_pdsh_percent_escapes():
    """pdsh expands %h, %u, %n and %% in the remote command: every % is doubled (checked on real hosts in
    test_env_injection.py), on top of the shell's escapes inside DeepSpeed's double quotes."""
    assert ds_env_value("50%") == "50%%" and ds_env_value("a %h $(x)") == "a %%h \\$(x)"
    assert ds_env_value("a\rb") is None and ds_env_value(" a") is None


def test_hostfile_lines_break_where_deepspeed_breaks_them(tmp_path):
    """Universal newlines (\\n, \\r\\n, \\r) end a hostfile line; a form feed or \\x85 inside one is an error at that
    line, not a second host."""
    f = tmp_path / "hostfile"
    f.write_text("h0 slots=1\r\nh1 slots=2\rh2 slots=1\n", newline="")
    assert parse_hostfile(f) == [("h0", 1), ("h1", 2), ("h2", 1)]
    for ch in ("\f", "\x85", "\u2028"):
        f.write_text(f"h0 slots=1{ch}h1 slots=1\n")
        assert _error(lambda: parse_hostfile(f)).startswith(f"{f}:1: "), ascii(ch)


@pytest.mark.parametrize("module", ["hostfile", "credentials"])
def test_the_launch_helpers_exit_2_with_one_line(tmp_path, module):
    """`python -m dflash_ds.distributed.hostfile env-file` (train_deepspeed.sh) and `... credentials`
    (train_slurm.sbatch): a value that cannot travel is one line on stderr naming the variable, status 2, nothing
    on stdout for the script to eval, no env file written; the value is not shown."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "WANDB_NAME": "run-1\rX;touch M;Y=1", "GCP_KEY": "-----BEGIN KEY-----\nMIIE\n-----END KEY-----"}
    if module == "hostfile":
        argv, named = ["env-file", str(tmp_path / "out"), "--credentials-dir", str(tmp_path / "c")], "WANDB_NAME"
    else:
        argv, named = [str(tmp_path / "c")], "GCP_KEY"
    r = subprocess.run([sys.executable, "-m", f"dflash_ds.distributed.{module}", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), r.stderr
    assert r.stderr.startswith(f"[dflash-ds] error: {named}: its value holds a ")
    assert "touch" not in r.stderr and "MIIE" not in r.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("c/*"))
    assert not os.path.exists(tmp_path / "M")
