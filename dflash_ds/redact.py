"""Secrets out of logs: what a log line, a command or a config dump shows of a credential is `***`.

Three rules, applied to every line a rank prints (docs/OPERATIONS.md: "What is filtered from output"):
1. Known values, anywhere: the value of every secret variable of the environment, and every value of a credential
   file a variable names (`HF_TOKEN_PATH`, `DFLASH_SECRETS_FILE`, any `<secret name>_PATH` / `_FILE`), each of
   8 characters or more; also each line of a multi-line one (a PEM key) and the value as JSON and repr escape it.
2. The value after a secret's name (`holds_secret`): `K=v` and `K = 'v'` (also in a URL's query: `?token=v&`),
   `--flag v`, `"key": v` (JSON, a dict; also escaped inside a string: `\\"key\\": \\"v\\"`), and YAML's
   `key: v` where a key can stand: a line's start, after a prefix that ends in punctuation (pdsh's `h1: `,
   `[rank0]: `, `] `, `- `), a logging level word, `{` or `,`. Not in prose: "no mask token: 16".
   null, none, true, false, yes, no, on, off and ~ stay (`PasswordAuthentication=no` keeps its meaning).
3. Credentials by their place: a URL's password (`https://user:***@host`, `redis://:***@h`), a URL's lone user
   when it is a token (`https://***@github.com`; not for ssh, whose user is a login), an HTTP Authorization
   header's credential after its scheme (`Authorization: token ***`) and `Bearer v` anywhere.
What it cannot see is not masked: a secret under an innocent name that is not in the environment or a named file,
a value split over lines. What it cannot tell apart is masked: a traceback's source line `token=token`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from dflash_ds.distributed.credentials import is_secret

MASK = "***"
# Shorter values would mask common words all over the log (a variable AUTH_MODE=none) without hiding a
# credential: real ones (HF, W&B, MLflow tokens) are 20 to 40 characters.
MIN_LEN = 8
_MAX_FILE_BYTES = 1 << 16  # read no more of a credential file: it is a token, a key or a few lines

# --- Which names hold a secret -----------------------------------------------------------------------------------
# The words of credentials.is_secret_name, matched as words (split at _ . - and camelCase) rather than anywhere:
# credentials' rule may take too much (forwarding a harmless variable by path costs nothing), but prose and
# diagnostics pass through this one, where `author`, `KeyError` and `eos_token` must stay readable. A word that
# is or ends with one counts (`apikey`, `HFTOKEN`, `oauth`), plurals too (`CREDENTIALS`), except:
_SECRET_WORD = re.compile(r"(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)S?$")
# - a word after it that says the name is about the secret, not the secret: where it is kept (`HF_TOKEN_PATH`,
#   `SSH_AUTH_SOCK`), the model's numbers (`mask_token_id`, `token_budget`, `num_key_value_heads`);
_ABOUT = frozenset({"ID", "IDS", "BUDGET", "PATH", "FILE", "DIR", "SOCK", "VALUE"})
# - a name that ends in one of these is an exception's, and what follows it is a message (`KeyError: 'x.weight'`,
#   `LocalTokenNotFoundError: Token is required`);
_EXCEPTION = frozenset({"ERROR", "EXCEPTION", "WARNING"})
# - TOKEN after a word that makes it the model's: the tokenizer's special tokens (`eos_token: <|endoftext|>`) and
#   a rate (`bytes_per_token`);
_MODEL_TOKEN = frozenset({"BOS", "EOS", "UNK", "SEP", "PAD", "CLS", "MASK", "PER"})
# - TOKENS and KEYS count or list the model's tokens and a dict's keys (`max_new_tokens`, `missing_keys`) unless a
#   word before them says who issued them (`API_TOKENS`, `HF_TOKENS`, `ACCESS_TOKENS`).
_ISSUERS = frozenset({"API", "ACCESS", "AUTH", "BEARER", "REFRESH", "SESSION", "HF", "SECRET", "PRIVATE"})


@functools.lru_cache(maxsize=4096)
def holds_secret(name: str) -> bool:
    """Whether the value written after `name` (a variable, flag or key) is a credential (the rule above)."""
    words = [w for w in re.split(r"[^A-Z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).upper()) if w]
    if words and words[-1] in _EXCEPTION:
        return False
    for i, word in enumerate(words):
        before, after = (words[i - 1] if i else ""), (words[i + 1] if i + 1 < len(words) else "")
        if not _SECRET_WORD.search(word) or after in _ABOUT:
            continue
        if word.endswith(("TOKENS", "KEYS")) and before not in _ISSUERS:
            continue
        if word == "TOKEN" and before in _MODEL_TOKEN:
            continue
        return True
    return False


# --- 1. Known values ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _forms(value: str) -> frozenset[str]:
    """The ways a log may show `value`: as is, each of its lines, as JSON and repr escape it (of MIN_LEN or more)."""
    forms = {value, *(line.strip() for line in value.splitlines()), json.dumps(value)[1:-1],
             json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1]}
    return frozenset(f for f in forms if len(f) >= MIN_LEN)


_ENV_LINE = re.compile(r"[ \t]*(?:export[ \t]+)?[A-Za-z_][A-Za-z0-9_]*=(?P<value>.*)")
# path -> (what stat said, the values): read again only when the file changes; what it held stays masked after it
# is removed or rewritten (the launcher removes the credentials folder as the job ends, while the last lines are
# still being written).
_FILE_VALUES: dict[str, tuple[tuple[int, int, int], frozenset[str]]] = {}


def _file_values(path: str) -> frozenset[str]:
    """The secrets of a credential file: each `K=V` line's value (a secrets file), else each line (a token file)."""
    cached = _FILE_VALUES.get(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a fifo or a device would block or never end
            return frozenset()
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if cached and cached[0] == sig:
            return cached[1]
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(_MAX_FILE_BYTES)
    except OSError:  # gone or unreadable: what it held is still secret; never an error from the filter
        return cached[1] if cached else frozenset()
    values = set(cached[1]) if cached else set()
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = _ENV_LINE.fullmatch(line)
        value = (m["value"] if m else line).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values |= _forms(value)
    _FILE_VALUES[path] = (sig, frozenset(values))
    return _FILE_VALUES[path][1]


def _known_values(env: Mapping[str, str]) -> list[str]:
    """Every form of every secret value of `env` and of the credential files it names, longest first."""
    values: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        if is_secret(name, value) or holds_secret(name):  # both rules: a value wrongly masked costs little
            values |= _forms(value)
        elif name.upper().endswith(("_PATH", "_FILE")) and holds_secret(name[:-5]):  # HF_TOKEN_PATH
            values |= _file_values(value)
    return sorted(values, key=len, reverse=True)  # a value that contains another is masked whole


# --- 2. The value after a secret's name --------------------------------------------------------------------------
_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"
# A quote, escaped as deep as its string is nested (a JSON document inside a JSON string: \"key\": \"v\").
_QUOTED = r"""(?P<q>\\*["'])(?P<inner>(?:\\.|[^\\\n])*?)(?P=q)"""
# A name where one can start (not inside a word: a long base64 blob is not rescanned at every character) and its
# separator: a quoted key's `:`; a --flag's blanks; `=` (blanks around it allowed, `==` is code) or `:` and a blank.
_CANDIDATE = re.compile(rf"(?P<kq>\\*[\"'])(?P<qname>{_NAME})(?P=kq)[ \t]*:[ \t]*"
                        rf"|(?<![A-Za-z0-9_.\-])(?P<flag>--{_NAME})[ \t]+"
                        rf"|(?<![A-Za-z0-9_.\-])(?P<name>(?:--?)?{_NAME})(?:(?P<eq>[ \t]*=(?!=)[ \t]*)|[ \t]*:[ \t]+)")
# A bare value after `=` runs to a blank, a quote or backtick, `;` or `&` (a shell's separators, a URL query's),
# less closing punctuation at its end (`f(token=v)`); one that opens { is a structure whose own keys are matched,
# one with a ( is code in a traceback (`token = tok.decode(ids)`), which a shell line cannot hold unquoted. A list
# of scalars is masked whole: `HF_TOKENS: [a, b]` -> `[***]`.
_LIST = r"\[(?P<items>[^\[\]{}\n]*)\]"
_EQ_VALUE = re.compile(rf"{_QUOTED}|{_LIST}|(?P<bare>[^\s;&'\"`\[({{][^\s;&'\"`]*)")
_FLAG_VALUE = re.compile(rf"{_QUOTED}|{_LIST}|(?P<bare>[^\s;'\"\-][^\s;'\"]*)")  # not "-": that is the next flag


@functools.lru_cache(maxsize=None)
def _colon_value(stop: str = "") -> re.Pattern:
    """YAML / JSON: a bare value runs to the line's end or , } ] (a flow mapping), trailing blanks left out; in a
    quoted string (`-H 'X-Api-Key: v'`) also to its closing quote, `stop`."""
    end = "\\n,}\\]" + stop
    return re.compile(rf"{_QUOTED}|{_LIST}|(?P<bare>[^\s,'\"{{}}\[\]](?:[^{end}]*[^\s{end}])?)")


# Where a YAML key can stand: after a line's start or a prefix ending in punctuation (pdsh's `h1:`, `[rank0]:`,
# `]`, `|`, `-`, `>`, a quote: `-H 'X-Api-Key: v'`), after `{` or `,`, or after a logging level word.
_KEY_AFTER = ":])|>{,-\"'"
_LEVEL_END = re.compile(r"(?:\A|\W)(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\Z")
# Values that say whether, never what: `ssh -o PasswordAuthentication=no` keeps its meaning in an error message.
_LITERALS = {"null", "none", "true", "false", "yes", "no", "on", "off", "~"}


def _key_stands(text: str, line_start: int, at: int) -> str | None:
    """Whether a YAML key can stand at `at`; what it follows then ("" or the punctuation; a quote ends its value)."""
    while at > line_start and text[at - 1] in " \t":
        at -= 1
    if at == line_start:
        return ""
    if text[at - 1] in _KEY_AFTER:
        return text[at - 1]
    return "" if _LEVEL_END.search(text, max(line_start, at - 9), at) else None


def _mask_names(text: str) -> str:
    """`text` with the value after each secret name masked."""
    out, pos, line_start = [], 0, 0
    while m := _CANDIDATE.search(text, pos):
        name = m["qname"] or m["flag"] or m["name"]
        line_start = text.rfind("\n", pos, m.start()) + 1 or line_start  # only the text since the last candidate
        if m["qname"]:
            value_re = _colon_value()
        elif m["flag"]:
            value_re = _FLAG_VALUE
        elif m["eq"] is not None:
            value_re = _EQ_VALUE
        elif (after := _key_stands(text, line_start, m.start())) is not None:  # key: value
            value_re = _colon_value(after if after in ("'", '"') else "")
        else:
            value_re = None
        v = value_re.match(text, m.end()) if value_re and holds_secret(name) else None
        end = v.end() if v else m.end()
        if v is None:
            value, ends = "", ("", "")
        elif v["q"]:  # kept around the mask, so the line still parses
            value, ends = v["inner"], (v["q"], v["q"])
        elif v["items"] is not None:
            value, ends = v["items"].strip(), ("[", "]")
        elif value_re is _EQ_VALUE:  # a call is code (`token = tok.decode(ids)`); `f(token=v)` keeps its )
            value = "" if "(" in v["bare"] else v["bare"].rstrip(",)]}")
            end, ends = m.end() + len(value), ("", "")
        else:
            value, ends = v["bare"], ("", "")
        if not value or value.lower() in _LITERALS:
            out.append(text[pos:m.end()])
            pos = m.end()
        else:
            out.append(text[pos:m.end()] + ends[0] + MASK + ends[1])
            pos = end
    return "".join(out) + text[pos:]


# --- 3. Credentials by their place -------------------------------------------------------------------------------
_URL_USERINFO = re.compile(r"(?P<head>(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://)"
                           r"(?P<user>[^\s:/@]*)(?::(?P<pw>[^\s/@]*))?@")
_LOGIN_SCHEMES = ("ssh", "sftp", "scp", "rsync", "git")  # their URL's user is an account: ssh://git@host
_AUTHORIZATION = re.compile(r"(?P<head>(?<![\w-])(?:proxy-)?authorization\\*[\"']?[ \t]*[:=][ \t]*\\*[\"']?"
                            r"(?:[A-Za-z][\w.\-]*[ \t]+(?=[^\s\"'\\]))?)(?P<cred>[^\s\"'\\,;}]+)", re.IGNORECASE)
_BEARER = re.compile(r"(?P<head>\bBearer[ \t]+)[A-Za-z0-9._~+/=\-]{8,}")  # an Authorization header's value alone


def _mask_userinfo(m: re.Match) -> str:
    """A URL with its password masked, or its lone user when that is a token (a login scheme's user stays)."""
    if m["pw"] is not None:
        return f"{m['head']}{m['user']}:{MASK if m['pw'] else ''}@"
    if m["user"] and not m["scheme"].lower().endswith(_LOGIN_SCHEMES):
        return f"{m['head']}{MASK}@"
    return m[0]


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value masked (the module's docstring lists the rules)."""
    for value in _known_values(os.environ if environ is None else environ):
        text = text.replace(value, MASK)
    text = _URL_USERINFO.sub(_mask_userinfo, text)
    text = _AUTHORIZATION.sub(lambda m: m["head"] + MASK, text)
    text = _BEARER.sub(lambda m: m["head"] + MASK, text)
    return _mask_names(text)


def redact_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """A command line as it may be logged: each word redacted, and the word after a secret `--flag` masked."""
    out: list[str] = []
    for i, word in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev.startswith("--") and "=" not in prev and holds_secret(prev) and not word.startswith("--"):
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
        self._gone = False  # the reader closed the pipe (_put)
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
                self._put(redact(head + newline))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._put(redact(self._pending))
                self._pending = ""
            self._put("")

    def _put(self, text: str) -> None:
        """Write `text` (a flush when empty) until the stream's reader is gone, then nothing.

        A rank's console is a pipe to its launcher, under pdsh an ssh session: a SIGTERM to every process of a
        launch ends that first, and the next print raised BrokenPipeError in the middle of the stop (seen: the
        leader died before its checkpoint). Whatever it prints after that has no reader anyway."""
        if self._gone:
            return
        try:
            if text:
                self._stream.write(text)
            else:
                self._stream.flush()
        except BrokenPipeError:
            self._gone = True

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
