"""`eval --engine vllm --plain-cache DIR`: the plain server's greedy outputs, kept for the next eval of the same target.

The plain server is the lossless reference and does not depend on the drafter, so evaluating several
drafters (or checkpoints) against one target and one prompt set needs it once. One JSON file per key in
DIR; the key is the sha256 of everything the plain outputs depend on (`plain_key_fields`), and the file
carries those fields beside the outputs, so that `cat` says what it is the reference of. The target folder
is identified by its resolved path and each of its files' name, size and mtime_ns: cheap (a 27B target's
weights are not read) and changed by any rewrite of a file in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from dflash_ds.errors import DFlashError


def target_identity(target: str | Path) -> dict:
    """The target folder's resolved path and, for each file directly in it, name, size and mtime_ns."""
    folder = Path(target).resolve()
    files = []
    for path in sorted(folder.iterdir()):
        if path.is_file():
            st = path.stat()
            files.append({"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"path": str(folder), "files": files}


def plain_key_fields(target: str | Path, prompts: list[list[int]], *, max_new_tokens: int, dtype: str,
                     max_model_len: int | None, extra_args: list[str] | tuple[str, ...], env: dict[str, str],
                     python: str, concurrency: int) -> dict:
    """Everything the plain server's greedy outputs depend on, as JSON-ready values (the prompts as a digest).
    The concurrency too: it shapes the server's batches, and a near-tie can resolve otherwise in another batch
    shape (seen on this CPU build)."""
    digest = hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()
    return {"target": target_identity(target), "prompts": {"count": len(prompts), "sha256": digest},
            "max_new_tokens": max_new_tokens, "dtype": dtype, "max_model_len": max_model_len,
            "concurrency": concurrency, "extra_args": list(extra_args), "env": dict(sorted(env.items())),
            "python": os.path.abspath(python)}


def cache_path(cache_dir: str | Path, fields: dict) -> Path:
    """The file in `cache_dir` for these key fields: plain-<sha256 of the fields>.json; the folder is created
    here, before any server starts, so that an unusable one fails first."""
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DFlashError(f"--plain-cache {cache_dir}: cannot create the folder ({exc.strerror or exc})") from None
    return Path(cache_dir) / f"plain-{key}.json"


def read_plain(path: Path, fields: dict) -> list[list[int]] | None:
    """The cached outputs at `path`, or None when there are none; a file that does not hold them for these
    fields gets one warning line and reads as a miss (the caller serves plain and overwrites it)."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        outputs = stored["outputs"]
        if stored["key_fields"] != fields:
            raise ValueError("its key fields are not this run's")
        if len(outputs) != fields["prompts"]["count"] or not all(
                isinstance(o, list) and all(isinstance(t, int) for t in o) for o in outputs):
            raise ValueError("its outputs are not one list of token ids per prompt")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"warning: --plain-cache {path} is unreadable ({type(exc).__name__}: {exc}); serving the target "
              "plain again and overwriting it", file=sys.stderr, flush=True)
        return None
    return outputs


def write_plain(path: Path, fields: dict, outputs: list[list[int]]) -> None:
    """Store the outputs with their key fields, atomically: a temporary file in the same folder, then os.replace."""
    # The key fields indented, one output per line: readable with cat, small for long outputs.
    text = ('{"key_fields": ' + json.dumps(fields, indent=2) + ',\n"outputs": [\n'
            + ",\n".join(json.dumps(o) for o in outputs) + "\n]}\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
