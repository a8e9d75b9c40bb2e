"""Secrets out of logs: what a log line, a command or a config dump shows of a credential is `***`.

Masked (`redact`):
- the values of this process's secret variables (`credentials.is_secret_name`: names holding TOKEN, KEY, SECRET,
  PASSWORD, CREDENTIAL or AUTH, less an allowlist) of 8 characters or more, wherever they appear;
- the value after a secret-looking name, bare or quoted: `HF_TOKEN=v`, `WANDB_API_KEY="v"`, `export K='v';`,
  `--hf-token v`, `--api-key 'v w'`, `--wandb.api_key=v`, JSON / YAML / Python dicts (`"api_key": "v"`,
  `token: v`, `{'hf_token': 'v'}`); null, none, true, false, yes, no, on and off (any case) are left as
  they are;
- the password of a URL (`https://user:v@host` -> `https://user:***@host`), an HTTP `Bearer v` / `Basic v`.
What it cannot see is not masked: a secret under an innocent name that is not in the environment, a value
split over lines.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from dflash_ds.distributed.credentials import is_secret, is_secret_name

MASK = "***"
# Shorter values would mask common words all over the log (a variable AUTH_MODE=none) without hiding a
# credential: real ones (HF, W&B, MLflow tokens) are 20 to 40 characters.
MIN_LEN = 8
# A name starts where a word does: tried at every character of a long word (a base64 blob, a path), a pattern would
# rescan the rest of it each time, and one long line would take minutes.
_NAME = r"(?<![A-Za-z0-9_.\-])[A-Za-z_][A-Za-z0-9_.\-]*"
_QUOTED = r"""(?P<q>["'])(?P<inner>(?:\\.|(?!(?P=q)).)*)(?P=q)"""
# NAME=VALUE (a shell assignment, a --flag=value); a bare value runs to the next blank, quote or semicolon.
_ASSIGN = re.compile(rf"(?P<name>(?<![A-Za-z0-9_.\-])(?:--?)?[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>=)(?:{_QUOTED}|(?P<bare>[^\s;'\"]+))")
# --flag VALUE; a bare value must not start with "-" (that is the next flag).
_FLAG = re.compile(rf"(?P<name>(?<![A-Za-z0-9_.\-])--[A-Za-z_][A-Za-z0-9_.\-]*)(?P<sep>\s+)"
                   rf"(?:{_QUOTED}|(?P<bare>[^\s;'\"-][^\s;'\"]*))")
# "key": value / 'key': value anywhere (JSON, a Python dict); key: value where YAML or a dict has its keys (a line's
# start, after "- ", "{" or ","), not in prose ("a config key: none"). A bare value ends at , } ] too; a { or [
# opens a nested value, which is matched on its own.
_VALUE = rf"(?:{_QUOTED}|(?P<bare>[^\s,;'\"{{}}\[\]][^\s,;'\"}}\]]*))"
_KEY_QUOTED = re.compile(rf"(?P<kq>[\"'])(?P<name>{_NAME})(?P=kq)(?P<sep>[ \t]*:[ \t]*){_VALUE}")
_KEY_BARE = re.compile(rf"(?:^[ \t]*(?:-[ \t]+)?|(?<=[{{,])[ \t]*)(?P<name>{_NAME})(?P<sep>[ \t]*:[ \t]+){_VALUE}",
                       re.MULTILINE)
_BEARER = re.compile(r"(?P<head>\b(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=\-]{8,})")  # an HTTP Authorization
_URL_PASSWORD = re.compile(r"(?P<head>(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]+:)"
                           r"(?P<pw>[^\s/@]+)(?P<at>@)")
# Values that say whether, never what: `ssh -o PasswordAuthentication=no` keeps its meaning in an error message.
_LITERALS = {"null", "none", "true", "false", "yes", "no", "on", "off", "~"}


def _mask_value(m: re.Match) -> str:
    """The match with its value masked when its name is a secret's (quotes kept, so the line still parses)."""
    value = m["inner"] if m["q"] else m["bare"]
    if not is_secret_name(m["name"]) or not value or value.lower() in _LITERALS:
        return m[0]
    head = m[0][: m.start("sep") - m.start(0)] + m["sep"]
    return head + (f"{m['q']}{MASK}{m['q']}" if m["q"] else MASK)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value masked (the module's docstring lists the forms)."""
    env = os.environ if environ is None else environ
    values = sorted({v for k, v in env.items() if is_secret(k, v) and len(v) >= MIN_LEN}, key=len, reverse=True)
    for value in values:  # longest first: a value that contains another is masked whole
        text = text.replace(value, MASK)
    text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], text)
    text = _BEARER.sub(lambda m: m["head"] + MASK, text)
    for pattern in (_ASSIGN, _FLAG, _KEY_QUOTED, _KEY_BARE):
        text = pattern.sub(_mask_value, text)
    return text


def redact_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """A command line as it may be logged: each word redacted, and the word after a secret `--flag` masked."""
    out: list[str] = []
    for i, word in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev.startswith("--") and "=" not in prev and is_secret_name(prev) and not word.startswith("--"):
            out.append(MASK)
        else:
            out.append(redact(word, environ))
    return out


class _RedactedStream:
    """A text stream that writes `redact`ed whole lines to another (a partial line waits for its end or a flush:
    `print` writes a name and its value in separate calls)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._pending = ""
        # The watchdog and the bridge's threads print too. Reentrant: a signal handler that prints may interrupt a
        # write on the same thread; made anew in a forked child (a data worker), where another thread may hold it.
        self._lock = threading.RLock()
        os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            head, newline, self._pending = (self._pending + text).rpartition("\n")
            if newline:
                self._stream.write(redact(head + newline))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._stream.write(redact(self._pending))
                self._pending = ""
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ... are the stream's
        return getattr(self._stream, name)


def redact_stdio(copiers: Sequence[str] = ()) -> None:
    """Redact what this process prints through sys.stdout and sys.stderr from now on (print, logging handlers
    made later, warnings, tracebacks); native code writing to fds 1 and 2 itself is not seen. `copiers`: modules
    that patch the streams' write on import to copy the console elsewhere (W&B's console_capture: output.log and
    the cloud), imported first so that the filter sits on top and they copy filtered text."""
    import importlib

    for module in copiers:
        try:
            importlib.import_module(module)
        except ImportError:  # not installed: nothing copies the console
            pass
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _RedactedStream):
            setattr(sys, name, _RedactedStream(stream))


def main() -> int:
    """`python -m dflash_ds.redact`: copy stdin to stdout, redacted line by line (for a launcher's log)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a Ctrl-C meant for the job: the log goes on to EOF
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.reconfigure(errors="replace")
    for line in sys.stdin:
        sys.stdout.write(redact(line))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
