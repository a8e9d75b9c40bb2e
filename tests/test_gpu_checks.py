"""The prepared GPU checks cannot pass without a GPU: on this CPU torch they fail in their first seconds,
naming why, and a GPU test that skips fails under DFLASH_REQUIRE_GPU=1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from proc_utils import run_bounded

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_check_2gpu.sh"])
def test_gpu_check_with_device_cuda_fails_at_once_on_a_cpu_torch(script, tmp_path):
    env = {**os.environ, "DEVICE": "cuda", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    r = run_bounded(["bash", str(ROOT / "launch" / script)], 60, env=env, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "preflight failed" in r.stdout, r.stdout[-2000:]
    log = (tmp_path / "out" / "preflight.log").read_text()
    assert "torch.cuda.is_available() is False (a CPU build" in log, log
    assert [p.name for p in (tmp_path / "out").glob("*.log")] == ["preflight.log"]  # nothing ran after it


def test_require_gpu_turns_a_gpu_skip_into_a_failure():
    test = "tests/test_core/test_drafter_flex.py"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-k", "gpu"]
    r = run_bounded(cmd, 120, cwd=ROOT, env={**os.environ, "DFLASH_REQUIRE_GPU": "1"})
    assert r.returncode == 1 and "3 error" in r.stdout, r.stdout[-2000:]
    assert "DFLASH_REQUIRE_GPU=1 but skipped" in r.stdout and "needs a CUDA GPU" in r.stdout, r.stdout[-2000:]
