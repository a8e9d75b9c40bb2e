"""A checkpoint's manifest: what a complete checkpoint holds, checked before a run resumes from it.

A save (runtime/checkpoint.py) writes every file into `step_N.partial`; then every drafter rank fsyncs every
file there (a host that loses power after the rename must not come back with a COMPLETE checkpoint of empty
files: without fsync, ext4 and XFS may write the rename before the data), rank 0 writes `MANIFEST.json` (each
file's size and sampled digest, runtime/digest.py), fsyncs it, writes COMPLETE and renames the folder.

A resume checks the newest complete checkpoint against its manifest (every rank: ~16 MiB read a file, so ~0.5 GB
for a Qwen3-8B drafter's 15 GB); one that fails (a file missing, cut short, zero-filled or rewritten: a disk
that lost blocks, a hand-edited folder) is named with its first bad file and `--resume auto` takes the
previous complete checkpoint instead. Checkpoints from before the manifest (none in the folder) are taken as they
are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_ds.runtime.digest import file_digest

MANIFEST = "MANIFEST.json"
VERSION = 1


def _files(folder: Path, skip: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def fsync_path(path: Path) -> None:
    """fsync one file or folder (a folder: its entries, so a rename in it reaches the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write `path` and fsync it."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def sync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder` (and itself): what this host wrote there reaches the disk.

    Every drafter rank calls it on the same folder while others may still write there (rank 0's export goes into
    a temporary folder renamed into place): an entry gone between the listing and its fsync was moved or removed
    by the rank that wrote it, which syncs it itself once written, so it is passed over (os.walk skips a folder
    that vanishes the same way)."""
    dirs, files = [], []
    for top, _subdirs, names in os.walk(folder):
        dirs.append(Path(top))
        files += [Path(top) / n for n in names]
    for path in [*files, *dirs[::-1]]:  # the folder itself last: its entries' renames
        try:
            fsync_path(path)
        except FileNotFoundError:
            pass


def write_manifest(folder: Path, skip: tuple[str, ...] = ()) -> dict:
    """Write `folder`/MANIFEST.json for every file under it but `skip` (paths relative to it) and the manifest;
    fsynced. Returns what it wrote."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "digest": file_digest(p)}
             for p in _files(folder, (*skip, MANIFEST))}
    manifest = {"version": VERSION, "digest": "sha256 of the size, name and 256 spread 64 KiB samples "
                                              "(whole below 16 MiB), runtime/digest.py", "files": files}
    tmp = folder / f".{MANIFEST}.tmp"
    write_synced(tmp, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / MANIFEST)
    return manifest


def check_manifest(folder: Path) -> str | None:
    """None when every file the manifest lists is there with its size and digest (or there is no manifest: a
    checkpoint from before it); else what is wrong, naming the first bad file."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"
    for rel, want in sorted(files.items()):
        f = folder / rel
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} holds {size:,} bytes, the manifest says {want['size']:,} (cut short or rewritten)"
        if file_digest(f) != want["digest"]:
            return f"{f} does not match its digest in the manifest (its bytes changed since the save)"
    return None
