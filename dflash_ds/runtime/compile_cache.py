"""Compiled kernels kept in the run's folder (`train.compile_cache`): a restart on any node skips compiling them.

What a GPU run compiles: flex_attention (models/block_mask.py: 2 graphs while training, each a 40-70 s cold
compile on the H200, forward and backward) and the fused elementwise functions (components/fusion.py: about 10
graphs at the Qwen3-8B preset, Triton kernels with their autotuning). torch keeps them in a per-machine cache
(/tmp/torchinductor_<user>), so a restart on the same node finds them; a job requeued onto other nodes, or whose
/tmp a scheduler's epilog wiped, compiled everything again on every rank, minutes of idle GPUs per restart.

torch's portable cache ("mega-cache", `torch.compiler.save_cache_artifacts` / `load_cache_artifacts`: inductor's
graphs, AOT autograd's, the Triton kernels bundled with them, autotuning results and dynamic-shape profiles,
keyed by torch/Triton versions and the device) is written here by the leader after each checkpoint and loaded by
every training rank before it builds its engine. Layout: `<output_dir>/compile_cache/<16 hex>.bin`, one file per
set of artifacts, and `index.json` (file -> the artifact keys in it). A save whose keys are all in the folder
writes nothing (a resumed run that compiled nothing new: torch records the artifacts it hit as well); a larger
set replaces the files it covers. Sizes: a few MB (CPU: the graphs' C++ source; on a CPU, inductor still
compiles that source after a hit, so the saving there is the tracing and lowering only).

A file that cannot be read or loaded (another torch, a torn copy) is skipped with one warning: compiling again is
the worst case, never a failed start. So is a file another user could have written: torch's loader puts the bytes
into the compile caches as they are (pickles, Python source that inductor imports), so whoever can write a
loaded file runs code on every rank. Loaded are regular files in this folder owned by this process's user and
not writable by group or others, checked on the opened file (fstat: a name swapped after a check changes
nothing); save writes them so (0o644 less the umask), whatever train.umask says.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

FOLDER = "compile_cache"
INDEX = "index.json"


def folder(out: Path) -> Path:
    """The run's compile cache folder."""
    return Path(out) / FOLDER


def _read_index(where: Path) -> dict[str, list[str]]:
    try:
        return {str(k): list(v) for k, v in json.loads((where / INDEX).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover (or planted link) of that name: O_EXCL makes a file of our own
    # 0o644, not the default 0o666: under a group-writable umask (002) the file would fail load's own check
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Untrusted(Exception):
    """A cache file this process must not hand to torch's loader."""


def _read_trusted(path: Path) -> bytes:
    """The file's bytes if it is a regular file of this user that group and others cannot write; else _Untrusted
    saying why."""
    # O_NONBLOCK: a FIFO under a listed name would block the open (the rank's start) for good; a regular file
    # reads as usual.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)  # what was opened, not what the name points at now
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted("not a regular file")
        if st.st_uid != os.geteuid():
            raise _Untrusted(f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise _Untrusted(f"mode {stat.filemode(st.st_mode)}: group or others may write it")
        return f.read()


def _keys(info) -> list[str]:
    """The distinct artifact keys of a torch CacheInfo, as "kind/key" (torch may list one twice)."""
    return sorted({f"{kind}/{key}" for kind, names in info.artifacts.items() for key in names})


def load(out: Path) -> tuple[int, int]:
    """Load every artifact file of the run's cache into this process's compile caches: (files, artifacts) loaded."""
    import torch

    where = folder(out)
    files = artifacts = 0
    for name in sorted(_read_index(where)):
        try:
            if Path(name).name != name or name == "..":
                raise _Untrusted("not a file name in this folder")  # the index cannot point elsewhere
            # torch returns None for bytes it cannot read (logging its own traceback), raises for other faults
            info, why = torch.compiler.load_cache_artifacts(_read_trusted(where / name)), "not torch's artifacts"
        except _Untrusted as exc:
            info, why = None, f"{exc}: torch's loader would run what it holds"
        except Exception as exc:  # noqa: BLE001 - any failure means compiling again, never a failed start
            info, why = None, f"{type(exc).__name__}: {exc}"
        count = len(_keys(info)) if info is not None else 0
        if not count:
            print(f"[dflash-ds] warning: compile cache {where / name} not loaded ({why}); its graphs compile again",
                  file=sys.stderr, flush=True)
            continue
        files, artifacts = files + 1, artifacts + count
    return files, artifacts


def save(out: Path) -> int:
    """Write this process's compiled artifacts into the run's cache unless the folder holds them all: how many were
    written (0: nothing compiled, or nothing new)."""
    import torch

    try:
        saved = torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - the checkpoint is written; only the shortcut is lost
        print(f"[dflash-ds] warning: compiled artifacts not saved ({type(exc).__name__}: {exc})", file=sys.stderr,
              flush=True)
        return 0
    if saved is None:
        return 0
    data, info = saved
    keys = _keys(info)
    where = folder(out)
    index = _read_index(where)
    held = {k for ks in index.values() for k in ks}
    if not keys or set(keys) <= held:
        return 0
    where.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16] + ".bin"
    _write_atomic(where / name, data)
    covered = [old for old, ks in index.items() if old != name and set(ks) <= set(keys)]
    index = {k: v for k, v in index.items() if k not in covered}
    index[name] = keys
    _write_atomic(where / INDEX, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    for old in covered:
        (where / old).unlink(missing_ok=True)
    return len(keys)
