"""train.compile_cache loads only files no one else could have written (runtime/compile_cache.py): torch's loader
puts a file's bytes into the compile caches as they are, so a file another user could write runs their code on
every rank. Real cache files, written by compile_cache.save from an artifact recorded through torch's own cache
API (no compile: milliseconds), then given another owner (the suite runs as root), a group- or world-writable
mode, a FIFO's type, or swapped under its name once opened."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from torch.compiler._cache import CacheArtifactManager

from dflash_ds.runtime import compile_cache

KEY = "dflash-test/trust.best_config"  # an autotune artifact: loading it writes this file into inductor's cache
OTHER_UID = 12345


def save_one(out: Path) -> None:
    """compile_cache.save of one artifact: one file in the run's cache."""
    with CacheArtifactManager.with_fresh_cache():  # this process's own artifacts stay out of it, and it out of them
        CacheArtifactManager._ensure_cache_artifacts_registered()
        CacheArtifactManager.record_artifact("autotune", KEY, {"XBLOCK": 8, "num_warps": 1})
        assert compile_cache.save(out) == 1


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder whose compile cache holds one file of one artifact; inductor's cache folder empty."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    save_one(tmp_path / "run")
    return tmp_path / "run"


def load(out: Path) -> tuple[int, int]:
    with CacheArtifactManager.with_fresh_cache():
        return compile_cache.load(out)


def populated() -> bool:
    """Whether torch's loader ran on the file: the artifact is in inductor's cache folder."""
    return (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / KEY).is_file()


def cache_file(out: Path) -> Path:
    (name,) = json.loads((out / "compile_cache" / "index.json").read_text())
    return out / "compile_cache" / name


def swap_after_open(path: Path, monkeypatch) -> None:
    """A file of another user under the name; once it is opened, the name is given a trusted file (as a writer of
    the folder would, between a check by name and the read): only a check of the opened file sees the first."""
    trusted = path.with_name("trusted")
    trusted.write_bytes(path.read_bytes())
    os.chown(path, OTHER_UID, -1)
    real_open = os.open

    def open_then_swap(file, flags, *rest, **kw):
        fd = real_open(file, flags, *rest, **kw)
        if Path(file) == path:
            os.replace(trusted, path)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)


def fifo(path: Path, monkeypatch) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)  # no writer ever comes: opened without O_NONBLOCK, the start would wait for good


BAD = {
    "another_owner": (lambda p, mp: os.chown(p, OTHER_UID, -1),
                      f"owned by uid {OTHER_UID}, not by this user ({os.geteuid()})"),
    "group_writable": (lambda p, mp: p.chmod(0o660), "mode -rw-rw----: group or others may write it"),
    "world_writable": (lambda p, mp: p.chmod(0o602), "mode -rw-----w-: group or others may write it"),
    "swapped_after_open": (swap_after_open, f"owned by uid {OTHER_UID}"),
    "fifo": (fifo, "not a regular file"),
}


@pytest.mark.timeout(20)  # the fifo case hangs for good where the file is opened blocking
@pytest.mark.parametrize("case", list(BAD))
def test_a_file_someone_else_could_write_is_skipped_with_a_warning(run, case, monkeypatch, capsys):
    if os.geteuid() != 0 and case in ("another_owner", "swapped_after_open"):
        pytest.skip("giving a file to another user needs root (the suite's CI runs as root)")
    spoil, why = BAD[case]
    path = cache_file(run)
    spoil(path, monkeypatch)
    assert load(run) == (0, 0) and not populated()
    err = capsys.readouterr().err
    assert f"compile cache {path} not loaded ({why}" in err and "torch's loader would run what it holds" in err


def test_the_index_names_files_of_its_folder_only(run, capsys):
    """An index entry with a path (a trusted file elsewhere: the user's own) is not followed."""
    index = run / "compile_cache" / "index.json"
    name, keys = next(iter(json.loads(index.read_text()).items()))
    os.replace(run / "compile_cache" / name, run / "elsewhere.bin")
    index.write_text(json.dumps({"../elsewhere.bin": keys}))
    assert load(run) == (0, 0) and not populated()
    assert "elsewhere.bin not loaded (not a file name in this folder" in capsys.readouterr().err


def test_save_writes_files_load_trusts_under_a_group_writable_umask(tmp_path, monkeypatch):
    """train.umask "002" (a group that shares a run): the cache's files are still the owner's alone to write."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "run"
    previous = os.umask(0o002)
    try:
        save_one(out)
    finally:
        os.umask(previous)
    for path in (cache_file(out), out / "compile_cache" / "index.json"):
        assert path.stat().st_mode & 0o777 == 0o644, path
    assert load(out) == (1, 1) and populated()
