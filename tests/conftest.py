"""Session-wide fixtures: a tiny seeded Qwen3 target (HF folder) built once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

SHM = Path("/dev/shm")


SHM_PATTERN = "deepspeed_allreduce_buffer_*"
_SHM_BEFORE = pytest.StashKey[set]()  # the segments present when the run started


def _shm_segments() -> set[Path]:
    return set(SHM.glob(SHM_PATTERN)) if SHM.is_dir() else set()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite must not leave DeepSpeed shared-memory segments behind (tmpfs is RAM: a leak per run once filled
    this machine's memory and hung CI). Checked once for the whole run, by the process that started it: with
    `make test`'s parallel workers, one worker's live segments are not another's leak."""
    if not _is_xdist_worker(session.config):
        session.config.stash[_SHM_BEFORE] = _shm_segments()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove and report any segment the run leaked (after every worker has finished); the run then fails."""
    if _is_xdist_worker(session.config) or _SHM_BEFORE not in session.config.stash:
        return
    leaked = sorted(_shm_segments() - session.config.stash[_SHM_BEFORE])
    for p in leaked:
        p.unlink(missing_ok=True)
    if leaked:
        print(f"\nFAILED: {len(leaked)} shared-memory segments leaked into /dev/shm, e.g. {leaked[0].name}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
