"""Session-wide fixtures: a tiny seeded Qwen3 target (HF folder) built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    """The suite must not leave DeepSpeed shared-memory segments behind (tmpfs is RAM: a leak per
    run once filled this machine's memory and hung CI). Removes any it finds and reports them."""
    pattern = "deepspeed_allreduce_buffer_*"
    before = set(SHM.glob(pattern)) if SHM.is_dir() else set()
    yield
    leaked = sorted(set(SHM.glob(pattern)) - before) if SHM.is_dir() else []
    for p in leaked:
        p.unlink(missing_ok=True)
    if leaked:
        pytest.fail(f"{len(leaked)} shared-memory segments leaked into /dev/shm, e.g. {leaked[0].name}")


@pytest.fixture(scope="session")
def tiny_target_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (and cache per argument set) tiny targets: `factory(layers=2, seed=1) -> Path`."""
    from dflash_ds.tiny.target import make_tiny_target

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
