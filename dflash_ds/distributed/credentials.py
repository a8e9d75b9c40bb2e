"""Credentials on several hosts: never by value on a command line, in a log or in a file others can read.

The deepspeed launcher forwards variables to other hosts as `export K=V;` on pdsh's command line (visible in
`ps` on every host) and prints that command in its log. So `launch/train_deepspeed.sh` forwards no secret by
value: it writes each one into a folder of mode 0700 on the shared filesystem (files of mode 0600, removed
when the job ends) and forwards only paths, which the libraries read on each host:

- `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`) -> the file `hf_token`, named by `HF_TOKEN_PATH` (huggingface_hub
  reads the token from that file itself);
- every other secret (`WANDB_API_KEY`, ...) -> the file `secrets.env`, named by `DFLASH_SECRETS_FILE`; each rank
  loads it into its own environment as it starts (`load_secrets_file`), where W&B and the rest read it.

One rule says which names are secrets, for the env file, for what the launcher may forward and for redaction
(`is_secret_name`): a name holding TOKEN, KEY, SECRET, PASSWORD (PASSWD), CREDENTIAL or AUTH anywhere, in any
case (`HF_TOKEN`, `HF_HUB_TOKEN_X`, `WANDB_KEY`, `MLFLOW_TRACKING_TOKEN`, `AWS_SECRET_ACCESS_KEY`, `--api-key`),
except an allowlist: `TOKENIZERS_*`; names of where a secret is kept rather than the secret (`*_PATH`, `*_FILE`,
`*_DIR`, and `*_SOCK`: ssh-agent's `SSH_AUTH_SOCK`, which pdsh's ssh needs in the launcher's environment); and the
model's own vocabulary that logs must show: the words TOKENS and TOKENIZER (`--max-new-tokens`,
`embed_tokens.weight`), `*TOKEN_ID(S)`, `*TOKEN_BUDGET`, `*KEY_VALUE_HEADS` (`model.mask_token_id`).
A variable whose value holds a URL with a password is a secret too, whatever its name (`is_secret`).

Both files that carry variables as `NAME=value` lines (the deepspeed launcher's env file, hostfile.py, and
`secrets.env`) hold one variable per line, so a value may hold any printable or non-ASCII character but no line
break or other control character (`unsafe_char`): read by DeepSpeed (universal newlines) or `str.splitlines`, a
`\r` in a value would start a line of its own, i.e. a second variable, or a shell command on every host.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from dflash_ds.errors import DFlashError

SECRETS_FILE_VAR = "DFLASH_SECRETS_FILE"
HF_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # huggingface_hub's own names, HF_TOKEN first
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
_ALLOWED_PREFIXES = ("TOKENIZERS_",)
_ALLOWED_SUFFIXES = ("_PATH", "_FILE", "_DIR", "_SOCK", "TOKEN_ID", "TOKEN_IDS", "TOKEN_BUDGET", "KEY_VALUE_HEADS")


# Every character that ends a line for one of the files' readers (str.splitlines: \n \r \v \f \x1c \x1d \x1e
# \x85 \u2028 \u2029; DeepSpeed's open(): \n \r), every other C0/C1 control and DEL (a terminal or a log acts on
# them), and lone surrogates: bytes of the environment that are not UTF-8, which no file can hold as they are.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_CHAR_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\v": "a vertical tab", "\f": "a form feed",
               "\x85": "a next-line character", "\u2028": "a line separator", "\u2029": "a paragraph separator"}
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell can export and a `NAME=value` line can name


def unsafe_char(value: str) -> str | None:
    """The first character of `value` that a `NAME=value` line cannot carry, described (`a carriage return (\\r,
    U+000D)`), or None: printable and non-ASCII characters are all fine."""
    m = _UNSAFE.search(value)
    if m is None:
        return None
    ch = m.group()
    if "\ud800" <= ch <= "\udfff":
        return "bytes that are not UTF-8 text"
    return f"{_CHAR_NAMES.get(ch, 'a control character')} ({ascii(ch)[1:-1]}, U+{ord(ch):04X})"


def normalized_name(name: str) -> str:
    """`--wandb.api-key` -> `WANDB_API_KEY`: flags, config keys and variables compared alike."""
    return re.sub(r"[.\-]+", "_", name.strip().lstrip("-")).upper()


def is_secret_name(name: str) -> bool:
    """Whether a variable (or flag, or config key) named `name` holds a credential: its value must not travel."""
    n = normalized_name(name)
    if not n or n.startswith(_ALLOWED_PREFIXES) or n.endswith(_ALLOWED_SUFFIXES):
        return False
    # Words of the model, never a credential: a tokenizer (`--tokenizer DIR`), text tokens (`embed_tokens.weight`).
    n = n.replace("TOKENIZER", "").replace("TOKENS", "")
    return any(word in n for word in _SECRET_WORDS)


# scheme://user:password@host: a URL that carries its password (a proxy, a package index, a tracking server).
_URL_PASSWORD = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]+:[^\s/@]+@")


def is_secret(name: str, value: str) -> bool:
    """Whether a variable holds a credential: by its name (`is_secret_name`), or by a value that is or holds a URL
    with a password (`MLFLOW_TRACKING_URI=https://user:pw@host`, `HTTPS_PROXY=http://user:pw@proxy:3128`),
    whatever the name."""
    return is_secret_name(name) or bool(_URL_PASSWORD.search(value))


def secrets_of(environ: dict[str, str]) -> dict[str, str]:
    """The secret variables of `environ` that have a value (`is_secret`)."""
    return {k: v for k, v in environ.items() if v and is_secret(k, v)}


def _write_private(path: Path, text: str, encoding: str | None = None) -> None:
    """Create `path` with mode 0600 from the start (never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding=encoding) as f:
        f.write(text)


def write_credentials(folder: str | Path, secrets: dict[str, str]) -> dict[str, str]:
    """Write `secrets` into `folder` (made 0700 if missing; files 0600); returns the variables to forward instead:
    HF_TOKEN_PATH for the HF token, DFLASH_SECRETS_FILE for the rest (none when there is nothing to forward)."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # a folder made by mktemp -d is 0700 already; one given by the user may not be
    forward: dict[str, str] = {}
    rest = dict(secrets)
    hf = next((rest.pop(k) for k in HF_TOKEN_VARS if k in rest), None)
    for k in HF_TOKEN_VARS:  # a second HF name would only repeat the token
        rest.pop(k, None)
    if hf is not None:
        _write_private(folder / "hf_token", hf)
        forward["HF_TOKEN_PATH"] = str(folder.resolve() / "hf_token")
    lines = []
    for k, v in sorted(rest.items()):
        if not VARIABLE_NAME.fullmatch(k):  # e.g. an exported shell function (BASH_FUNC_get_token%%)
            print(f"[dflash-ds] warning: {k!r} is not forwarded to the ranks (not a variable name)", file=sys.stderr,
                  flush=True)
            continue
        bad = unsafe_char(v)
        if bad:  # the value never: the error is printed
            raise DFlashError(f"{k}: its value holds {bad}, which the secrets file cannot carry (one line per "
                              f"variable): keep it in a file on the shared filesystem and pass that file's path "
                              f"instead (as HF_TOKEN_PATH does for HF_TOKEN), or unset {k}")
        lines.append(f"{k}={_file_value(k, v)}")
    if lines:
        _write_private(folder / "secrets.env", "".join(f"{line}\n" for line in lines), encoding="utf-8")
        forward[SECRETS_FILE_VAR] = str(folder.resolve() / "secrets.env")
    return forward


def _file_value(name: str, value: str) -> str:
    """`value` as a secrets.env line holds it for `parse_secrets` to read it back as it is: bare, unless it is
    wrapped in a pair of quotes itself (`'x'`, `"x"`), which the reader would take off."""
    if not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
        return value
    if "'" not in value:
        return f"'{value}'"
    if not re.search(r'[\\"$`]', value):
        return f'"{value}"'
    raise DFlashError(f"{name}: its value is wrapped in quotes and holds both kinds: the secrets file cannot carry "
                      f"it; keep it in a file and pass that file's path instead, or unset {name}")


_SECRETS_LINE = re.compile(r"[ \t]*(?:export[ \t]+)?([^=]*)=(.*)")


def parse_secrets(text: str, where: str) -> dict[str, str]:
    """The variables of a secrets file's text: `NAME=value` lines (`export NAME=value` too, blank lines and `#`
    comments skipped; `\r\n` ends a line as `\n` does); a value as written, or inside one pair of quotes.
    DFlashError naming `where:line` and the variable, never a value, on a line that is not one variable."""
    found: dict[str, str] = {}
    # "\n" alone ends a line (str.splitlines would also break on \r, \v, \x85, \u2028, ...): any other line break
    # or control character left in a line is an error, not the start of another variable.
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip(" \t") or line.lstrip(" \t").startswith("#"):
            continue
        m = _SECRETS_LINE.fullmatch(line)
        if m is None or not VARIABLE_NAME.fullmatch(m.group(1)):  # a multi-line value's second line lands here
            raise DFlashError(f"{where}:{lineno}: not a NAME=value line (one variable per line; a value with line "
                              "breaks cannot be in this file: pass the path of a file that holds it instead)")
        name, value = m.groups()
        bad = unsafe_char(value)
        if bad:
            raise DFlashError(f"{where}:{lineno}: the value of {name} holds {bad}: one line per variable, and no "
                              "control character in it")
        quote = value[0] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else ""
        if quote:
            value = value[1:-1]
            if (quote == "'" and "'" in value) or (quote == '"' and re.search(r'[\\"$`]', value)):
                raise DFlashError(f"{where}:{lineno}: the value of {name} is quoted with a quote, backslash, $ or "
                                  "backquote inside: the file is not read by a shell; write it bare")
        found[name] = value
    return found


def load_secrets_file(environ: os._Environ | dict[str, str] = os.environ) -> list[str]:
    """Set the variables of $DFLASH_SECRETS_FILE that `environ` lacks (a rank, as it starts); returns their names.
    The values are never printed. A malformed file is a DFlashError naming its line, and sets nothing."""
    path = environ.get(SECRETS_FILE_VAR)
    if not path:
        return []
    try:
        # newline="": a \r stays in its line (to be refused) rather than ending it; UTF-8 whatever the host's locale,
        # as write_credentials wrote it on the launching host.
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as exc:  # the path only: never a value
        print(f"[dflash-ds] warning: cannot read {SECRETS_FILE_VAR}={path} ({exc.strerror}): no credentials from it",
              file=sys.stderr, flush=True)
        return []
    except UnicodeDecodeError as exc:
        raise DFlashError(f"{SECRETS_FILE_VAR}={path}: not UTF-8 text (byte {exc.start})") from None
    loaded = []
    for key, value in parse_secrets(text, path).items():
        if key not in environ:
            environ[key] = value
            loaded.append(key)
    return loaded


def shell_setup(environ: dict[str, str], forward: dict[str, str]) -> str:
    """The line a launch script evals: unset the secrets of `environ`, export the paths that replace them."""
    import shlex

    # A name the shell cannot unset would end the script (set -e); the launcher cannot forward one either.
    names = sorted(k for k in secrets_of(environ) if VARIABLE_NAME.fullmatch(k))
    return "; ".join([*(["unset " + " ".join(names)] if names else []),
                      *(f"export {k}={shlex.quote(v)}" for k, v in forward.items())])


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ds.distributed.credentials DIR`: write this environment's secrets into DIR; print the
    shell line that unsets them and exports their paths (launch/train_slurm.sbatch)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_ds.distributed.credentials",
                                     description="Move this environment's secrets (*TOKEN*, *KEY*, *SECRET*, "
                                                 "*PASSWORD*, *CREDENTIAL*, *AUTH*; credentials.is_secret_name) "
                                                 "into files; print the shell line to eval.")
    parser.add_argument("dir", help="a folder on the shared filesystem (made mode 0700) for the files, mode 0600: "
                                    "hf_token (named by HF_TOKEN_PATH) and secrets.env (DFLASH_SECRETS_FILE)")
    args = parser.parse_args(argv)
    environ = dict(os.environ)
    secrets = secrets_of(environ)
    try:
        forward = write_credentials(args.dir, secrets) if secrets else {}
    except DFlashError as exc:  # one line naming the variable, never its value; nothing on stdout to eval
        print(f"[dflash-ds] error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    print(shell_setup(environ, forward))
    return 0


if __name__ == "__main__":
    sys.exit(main())
