"""Shared fixtures of the trainer tests: a prepared tiny dataset and one uninterrupted reference run."""

from __future__ import annotations

import pytest

from conftest_runtime import COMMON
from runtime_utils import make_dataset, torchrun


@pytest.fixture(scope="session")
def setup(tiny_target_factory, tmp_path_factory):
    """A 6-layer tiny target and 96 prepared conversations."""
    target = tiny_target_factory(layers=6)
    data = make_dataset(target, tmp_path_factory.mktemp("data") / "prepared", n=96, max_length=256, block_size=8)
    return target, data


@pytest.fixture(scope="session")
def reference(setup, tmp_path_factory):
    """1 target + 2 drafters, ZeRO-2, 20 uninterrupted steps, W&B offline; every tensor handed to
    torch.distributed audited as if the groups were the GPU ones (`out/audit`, distributed/audit.py)."""
    target, data = setup
    out = tmp_path_factory.mktemp("ref")
    r = torchrun(3, [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out),
                     "--zero-stage", "2", "--wandb.enabled", "true"], cwd=out,
                 env={"DFLASH_DIST_AUDIT": str(out / "audit"), "DFLASH_DIST_AUDIT_AS": "nccl"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out, r
