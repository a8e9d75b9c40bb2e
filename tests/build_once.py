"""A build every pytest-xdist worker of a run needs, done once per run (`make test` runs two workers)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(folder)` once per test run however many workers `make test` runs (pytest-xdist): the workers share the
    parent of their base temporary folders (one per run), and the first to need the folder builds it under a file
    lock while the others wait, then all read it. For a seeded build every worker needs (the quality target: ~90 s on
    2 cores, once built by each of two workers)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a build another worker left half-done when it failed
            build(folder)
            done.touch()
    return folder
