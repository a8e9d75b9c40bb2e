"""Secrets out of logs: what a log line, a command or a config dump shows of a credential is `***`.

Two kinds of value are masked: the values of this process's secret variables (`credentials.is_secret_name`:
*TOKEN*, *API_KEY*, *SECRET*, *PASSWORD*), wherever they appear, and what follows a secret-looking name on a
command line (`HF_TOKEN=v`, `--hf-token v`, `--wandb.api_key=v`, `export WANDB_API_KEY=v;`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from dflash_ds.distributed.credentials import is_secret_name

MASK = "***"
MIN_LEN = 4  # shorter values (a flag such as "1") would mask half the log without hiding anything
# NAME=VALUE or --flag(=| )VALUE with a secret-looking name; VALUE runs to the next blank, quote or semicolon.
_ASSIGN = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>=)(?P<value>[^\s;'\"]+)")
_FLAG = re.compile(r"(?P<name>--[A-Za-z0-9_.\-]+)(?P<sep>\s+)(?P<value>[^\s;'\"-][^\s;'\"]*)")


def _name_is_secret(name: str) -> bool:
    return is_secret_name(name.lstrip("-").replace("-", "_").replace(".", "_"))


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value masked: the environment's secret values, and secret NAME=VALUE / --flag VALUE."""
    env = os.environ if environ is None else environ
    values = sorted({v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_LEN}, key=len, reverse=True)
    for value in values:  # longest first: a value that contains another is masked whole
        text = text.replace(value, MASK)
    for pattern in (_ASSIGN, _FLAG):
        text = pattern.sub(lambda m: m["name"] + m["sep"] + (MASK if _name_is_secret(m["name"]) else m["value"]),
                           text)
    return text


def redact_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """A command line as it may be logged: each word redacted, and the word after a secret `--flag` masked."""
    out: list[str] = []
    for i, word in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev.startswith("--") and "=" not in prev and _name_is_secret(prev) and not word.startswith("--"):
            out.append(MASK)
        else:
            out.append(redact(word, environ))
    return out


def main() -> int:
    """`python -m dflash_ds.redact`: copy stdin to stdout, redacted line by line (for a launcher's log)."""
    import signal
    import sys

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a Ctrl-C meant for the job: the log goes on to EOF
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.reconfigure(errors="replace")
    for line in sys.stdin:
        sys.stdout.write(redact(line))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
