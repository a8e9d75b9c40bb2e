"""The deepspeed launcher's hostfile: one `HOST slots=N` line per node, `#` comments, blank lines.

The deepspeed launcher reads a hostfile loosely: a missing file only warns (and the job runs
on local GPUs alone), `slots=0` and trailing garbage are accepted, and a bad line is reported
after its ssh checks have started. We parse it strictly up front so that a typo fails with
`file:line` before any process starts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dflash_ds.distributed.credentials import (VARIABLE_NAME, is_secret, secrets_of, shell_setup, unsafe_char,
                                               write_credentials)
from dflash_ds.errors import DFlashError

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]@]+$")  # hostnames, IPv4/IPv6 addresses, user@host


def parse_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """(host, slots) per node, in file order; DFlashError naming `file:line` on any malformed line."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"hostfile {path} does not exist (one 'HOST slots=N' line per node)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DFlashError(f"hostfile {path}: cannot read it ({exc})") from None
    hosts: list[tuple[str, int]] = []
    first_line: dict[str, int] = {}
    # Lines as DeepSpeed reads them (universal newlines: read_text() made \r and \r\n into \n): a \f or \x85 that
    # str.splitlines would break on stays in its line, and that line is refused below.
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.split("#", 1)[0].strip()  # a trailing comment is allowed, as in the example hostfile
        if not line:
            continue
        where = f"{path}:{lineno}"
        parts = line.split()
        host = parts[0]
        if host.startswith("slots="):
            raise DFlashError(f"{where}: missing host name before {host!r} (expected 'HOST slots=N')")
        if not _HOST.match(host):
            raise DFlashError(f"{where}: {host!r} is not a host name (expected 'HOST slots=N')")
        if len(parts) == 1:
            raise DFlashError(f"{where}: host {host!r} has no slots (expected '{host} slots=N', N = GPUs on it)")
        if not parts[1].startswith("slots="):
            raise DFlashError(f"{where}: expected 'slots=N' after host {host!r}, got {parts[1]!r}")
        value = parts[1][len("slots="):]
        if not value.isdigit() or int(value) < 1:
            raise DFlashError(f"{where}: slots={value} for host {host!r} is not a positive integer")
        if len(parts) > 2:
            raise DFlashError(f"{where}: unexpected text {' '.join(parts[2:])!r} after '{host} slots={value}'")
        if host in first_line:
            raise DFlashError(f"{where}: duplicate host {host!r} (first listed on line {first_line[host]})")
        first_line[host] = lineno
        hosts.append((host, int(value)))
    if not hosts:
        raise DFlashError(f"hostfile {path} lists no hosts (expected one 'HOST slots=N' line per node)")
    return hosts


# What the ranks read on every host that the deepspeed launcher does not forward by itself (it forwards only
# NCCL*, PYTHON*, MV2*, UCX*, MLFLOW* and the lines of .deepspeed_env): exact names, then prefixes.
FORWARD_NAMES = ("PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                 "PYTORCH_CUDA_ALLOC_CONF", "GLOO_SOCKET_IFNAME", "DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")
FORWARD_PREFIXES = ("HF_", "TRANSFORMERS_", "WANDB_", "DFLASH_", "TORCH_", "TORCHINDUCTOR_", "TRITON_")
# What the launcher forwards by itself (runner.EXPORT_ENVS, CUDA's export_envs): a value it would let the remote shell
# expand is written escaped to the env file instead, whose lines replace its own. PYTHONPATH is not: the launcher
# puts its working directory in front of it.
LAUNCHER_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW")


# DeepSpeed's pdsh runner builds `export K=V; ...` for the remote shell, V stripped and, when it holds anything but
# these characters, wrapped in double quotes (multinode_runner.add_export): inside them the shell still expands
# $, ` and \, so a value holding $(cmd) would run cmd on every host. `ds_env_value` escapes exactly those, and
# the % that pdsh itself expands.
_DS_PLAIN = re.compile(r"[\w@%+=:,./-]*")


def ds_env_value(value: str) -> str | None:
    """`value` as an env-file line must hold it for DeepSpeed's pdsh runner to hand the ranks `value` intact;
    None when it cannot travel (blanks at either end, which DeepSpeed strips; a line break or control character,
    which `check_forwarded` refuses first)."""
    if unsafe_char(value) is not None or value != value.strip():
        return None
    # pdsh replaces %h, %u and %n in the remote command (the host, the user, the node's rank: DeepSpeed's
    # --node_rank=%n) and %% by %: every % doubled reaches the ranks as one.
    value = value.replace("%", "%%")
    if _DS_PLAIN.fullmatch(value):
        return value  # DeepSpeed passes it bare: nothing to escape
    return re.sub(r'([\\"$`])', r"\\\1", value)


def _unquoted(value: str) -> str:
    """A user's env-file value as the remote shell would read it (`"abc"` -> abc) when it is one shell word."""
    import shlex

    try:
        words = shlex.split(value)
    except ValueError:
        return value
    return words[0] if len(words) == 1 and "$" not in value and "`" not in value else value


def _user_lines(user_files: list[Path]) -> list[tuple[str, str]]:
    """(name, value as written) of the user's env files' `NAME=value` lines (`export NAME=value` too; blank lines
    and `#` comments skipped), first file first, each name once (the first wins). DFlashError naming `file:line`
    on any other line, or a value with a line break or control character."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for f in user_files:
        if not f.is_file():
            continue
        try:  # newline="": "\n" alone ends a line (\r\n too, below); a \r, \f, \x85, ... in a line is refused
            with open(f, newline="") as fh:  # the locale's encoding, as DeepSpeed's runner opens it
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise DFlashError(f"{f}: cannot read it ({exc})") from None
        for lineno, line in enumerate(text.split("\n"), start=1):
            line = line.removesuffix("\r")
            if not line.strip(" \t") or line.lstrip(" \t").startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = re.sub(r"^[ \t]*export[ \t]+", "", key).strip(" \t")
            # DeepSpeed puts `export KEY=VALUE;` on every host's shell line: a KEY that is not a name is shell text.
            if not sep or not VARIABLE_NAME.fullmatch(key):
                raise DFlashError(f"{f}:{lineno}: not a NAME=value line (the deepspeed launcher runs `export "
                                  "NAME=value;` on every host)")
            bad = unsafe_char(value)
            if bad:
                raise DFlashError(f"{f}:{lineno}: the value of {key} holds {bad}: an env file has one variable per "
                                  "line, and no control character in it")
            if key not in seen:
                seen.add(key)
                out.append((key, value))
    return out


def _travels(name: str) -> bool:
    """Whether a variable of the launching environment reaches the other hosts: by the env file, or forwarded by
    the deepspeed launcher itself."""
    return name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES) or name.startswith(LAUNCHER_PREFIXES)


def check_forwarded(environ: dict[str, str]) -> None:
    """DFlashError naming the first variable that would reach other hosts (not a secret: those go by path) and
    that no `export NAME=value;` can carry: a name that is not one, or a value with a line break or control
    character (DeepSpeed reads the env file with universal newlines: after a \r the rest of the value would be a
    line of its own, an unquoted `export` on every host's shell line)."""
    for key, value in sorted(environ.items()):
        if not _travels(key) or is_secret(key, value):
            continue
        if not VARIABLE_NAME.fullmatch(key):
            raise DFlashError(f"{key!r} is not a variable name: the deepspeed launcher would put it on every "
                              "host's shell line as it is; unset it")
        bad = unsafe_char(value)
        if bad:
            raise DFlashError(f"{key}: its value holds {bad}, which cannot reach the other hosts (the deepspeed "
                              f"launcher's env file has one variable per line); remove it from the value, or unset "
                              f"{key}")


def deepspeed_env_text(environ: dict[str, str], user_files: list[Path], extra: dict[str, str] | None = None) -> str:
    """The lines of an env file for the deepspeed launcher: the user's files' lines first (theirs win, each value as
    written: it is the user's shell text), then every variable of `environ` the job uses that they do not set, then
    `extra`, these values escaped for DeepSpeed's shell line (`ds_env_value`). No secret is written
    (credentials.is_secret: by name, or a value holding a URL's password): they travel by path
    (`secret_variables`)."""
    import sys

    check_forwarded({**environ, **(extra or {})})
    lines: list[str] = []
    seen: set[str] = set()
    for key, value in _user_lines(user_files):
        seen.add(key)
        if not is_secret(key, value):
            lines.append(f"{key}={value}")
    wanted = [(k, v) for k, v in sorted(environ.items()) if k not in seen and not is_secret(k, v)
              and (k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)
                   or (k.startswith(LAUNCHER_PREFIXES) and k != "PYTHONPATH" and ds_env_value(v) not in (v, None)))]
    for key, value in [*wanted, *((k, v) for k, v in (extra or {}).items() if k not in seen)]:
        quoted = ds_env_value(value)
        if quoted is None:  # the name only: the value may be anything
            print(f"[dflash-ds] warning: {key} is not forwarded to other hosts (its value has blanks at an end, "
                  "which the deepspeed launcher strips)", file=sys.stderr, flush=True)
        else:
            lines.append(f"{key}={quoted}")
    return "".join(f"{line}\n" for line in lines)


def secret_variables(environ: dict[str, str], user_files: list[Path]) -> dict[str, str]:
    """The secrets the ranks need: those of the user's env files (theirs win), then this environment's."""
    found = {k: _unquoted(v.strip()) for k, v in _user_lines(user_files) if is_secret(k, v)}
    return {**secrets_of(environ), **found}


def ssh_keepalive(heartbeat_timeout_s: float) -> list[str]:
    """ssh options that end a session whose host has not answered for 1.25-1.5 x `heartbeat_timeout_s`.

    pdsh returns once its ssh session to every host has ended, and nothing ends one to a host that is cut off: the
    deepspeed runner and launch/train_deepspeed.sh waited on it for good after every rank had gone. OpenSSH ends a
    session (status 255) after ServerAliveCountMax unanswered keep-alives, one per ServerAliveInterval seconds of
    silence: C x I to (C + 1) x I seconds after the host went quiet. Over a heartbeat, so a link that pauses for
    less than the ranks wait out keeps its session; under two, the bound in which the ranks end (docs/OPERATIONS.md,
    "Reliability")."""
    interval = max(1, int(heartbeat_timeout_s // 8))
    count = max(1, math.ceil(1.25 * heartbeat_timeout_s / interval))
    return ["-o", f"ServerAliveInterval={interval}", "-o", f"ServerAliveCountMax={count}"]


def heartbeat_timeout_of(train_args: list[str]) -> float:
    """train.heartbeat_timeout_s as the ranks will read these trainer arguments: defaults < the --config file <
    --train.heartbeat_timeout_s (the last one given); the rest is the ranks' to check (dflash_ds/train.py)."""
    from dflash_ds.config import load_config
    from dflash_ds.config_parse import parse_overrides

    config, override = None, []
    for i, arg in enumerate(train_args):
        name, eq, value = arg.partition("=")
        given = [arg] if eq else train_args[i:i + 2]  # `--key=value` or `--key value` (parse_overrides' forms)
        if name == "--config":
            config = value if eq else (train_args[i + 1] if i + 1 < len(train_args) else None)
        elif name.replace("-", "_") == "__train.heartbeat_timeout_s":  # as parse_overrides reads `-` in a key
            override = given
    return load_config(config, parse_overrides(override)).train.heartbeat_timeout_s


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ds.distributed.hostfile env-file OUT [--credentials-dir DIR] [--user-env-file F]`: write
    the deepspeed launcher's env file (mode 0600, no secret) and the credentials; print the shell line that unsets
    the secrets and exports their paths. `... ssh-args -- TRAIN_ARGS`: print pdsh's ssh keep-alive options."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m dflash_ds.distributed.hostfile",
                                     description="Helpers of launch/train_deepspeed.sh.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env-file", help="write OUT: the lines of the user's env file (.deepspeed_env in ~ and the "
                                        "working directory, or --user-env-file; theirs win), then the job's "
                                        "variables from this environment (PATH, HF_*, WANDB_*, GLOO_SOCKET_IFNAME, "
                                        "...) so they reach every host, escaped for the launcher's shell line; no "
                                        "secret (*TOKEN*, *KEY*, *SECRET*, *PASSWORD*, *CREDENTIAL*, *AUTH*): "
                                        "those go to --credentials-dir, and OUT names them by path")
    p.add_argument("out", help="the file to write, mode 0600 (point DS_ENV_FILE at it)")
    p.add_argument("--credentials-dir", default=None,
                   help="a folder on the shared filesystem (mode 0700) for the secrets, files of mode 0600: "
                        "hf_token (forwarded as HF_TOKEN_PATH) and secrets.env (DFLASH_SECRETS_FILE); "
                        "without it secrets are not forwarded at all")
    p.add_argument("--user-env-file", default=None,
                   help="the DS_ENV_FILE the user set, read instead of .deepspeed_env and filtered the same way "
                        "(its secrets go to --credentials-dir); a relative name is looked up in ~ and the working "
                        "directory, as the deepspeed launcher does")
    k = sub.add_parser("ssh-args", help="print the ssh options (-o ServerAliveInterval=I -o ServerAliveCountMax=C) "
                                        "that end pdsh's session to a host silent for 1.25-1.5 x the "
                                        "train.heartbeat_timeout_s of TRAIN_ARGS")
    k.add_argument("train_args", nargs="*", metavar="TRAIN_ARGS", help="the trainer's arguments, after `--`")
    args = parser.parse_args(argv)
    if args.cmd == "ssh-args":
        try:
            print(" ".join(ssh_keepalive(heartbeat_timeout_of(args.train_args))))
        except DFlashError as exc:
            print(f"[dflash-ds] error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        return 0
    name = args.user_env_file or ".deepspeed_env"
    user = [Path(name), Path.home() / name]  # the launcher reads ~ first, . wins (an absolute name: one file)
    environ = dict(os.environ)
    try:  # bad input is one line naming the file:line or the variable (never a value), and status 2
        secrets = secret_variables(environ, user)
        check_forwarded(environ)  # before any credential is written
        forward = write_credentials(args.credentials_dir, secrets) if args.credentials_dir and secrets else {}
        text = deepspeed_env_text(environ, user, forward)
    except DFlashError as exc:
        print(f"[dflash-ds] error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # mktemp's file is 0600 already; a path of the user's may not be
    # The locale's encoding, as DeepSpeed's runner reads it back on this host and hands the values to pdsh.
    with os.fdopen(fd, "w") as f:
        f.write(text)
    # For the script to eval: the launcher must see no secret (it forwards MLFLOW_* by value itself), and it needs
    # the paths too when it runs a single host's ranks itself, without the env file.
    print(shell_setup(dict(os.environ), forward))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
