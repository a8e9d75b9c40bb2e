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
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

SECRETS_FILE_VAR = "DFLASH_SECRETS_FILE"
HF_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # huggingface_hub's own names, HF_TOKEN first
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
_ALLOWED_PREFIXES = ("TOKENIZERS_",)
_ALLOWED_SUFFIXES = ("_PATH", "_FILE", "_DIR", "_SOCK", "TOKEN_ID", "TOKEN_IDS", "TOKEN_BUDGET", "KEY_VALUE_HEADS")


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


def _write_private(path: Path, text: str) -> None:
    """Create `path` with mode 0600 from the start (never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
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
    lines = [f"{k}={v}" for k, v in sorted(rest.items()) if "\n" not in v]
    if lines:
        _write_private(folder / "secrets.env", "".join(f"{line}\n" for line in lines))
        forward[SECRETS_FILE_VAR] = str(folder.resolve() / "secrets.env")
    return forward


def load_secrets_file(environ: os._Environ | dict[str, str] = os.environ) -> list[str]:
    """Set the variables of $DFLASH_SECRETS_FILE that `environ` lacks (a rank, as it starts); returns their names.
    The values are never printed."""
    path = environ.get(SECRETS_FILE_VAR)
    if not path:
        return []
    try:
        text = Path(path).read_text()
    except OSError as exc:  # the path only: never a value
        print(f"[dflash-ds] warning: cannot read {SECRETS_FILE_VAR}={path} ({exc.strerror}): no credentials from it",
              file=sys.stderr, flush=True)
        return []
    loaded = []
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and key not in environ:
            environ[key] = value
            loaded.append(key)
    return loaded


def shell_setup(environ: dict[str, str], forward: dict[str, str]) -> str:
    """The line a launch script evals: unset the secrets of `environ`, export the paths that replace them."""
    import shlex

    # A name the shell cannot unset would end the script (set -e); the launcher cannot forward one either.
    names = sorted(k for k in secrets_of(environ) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
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
    print(shell_setup(environ, write_credentials(args.dir, secrets) if secrets else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
