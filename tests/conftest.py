"""Session-wide fixtures: a tiny seeded Qwen3 target (HF folder) built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def tiny_target_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (and cache per argument set) tiny targets: `factory(layers=2, seed=1) -> Path`."""
    from dflash_ds.tiny_target import make_tiny_target

    cache: dict[tuple, Path] = {}

    def factory(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_tiny_target(tmp_path_factory.mktemp("tiny_target"), **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_target(tiny_target_factory: Callable[..., Path]) -> Path:
    """The default tiny target (4 layers, hidden 128, vocab 512, seed 0), built once per session."""
    return tiny_target_factory()
