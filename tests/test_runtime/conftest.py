"""Shared fixtures of the trainer tests: a prepared tiny dataset and one uninterrupted reference run, each built
once per test run however many workers `make test` runs (tests/build_once.py: both workers had built both, a
~90-s torchrun job of 3 ranks among them). Tests read them and never write into them."""

from __future__ import annotations

import json
import subprocess

import pytest

from build_once import built_once
from conftest_runtime import COMMON
from runtime_utils import make_dataset, torchrun


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """A 6-layer tiny target and 96 prepared conversations."""
    from dflash_ds.tiny.target import make_tiny_target

    def build(folder):
        make_tiny_target(folder / "target", layers=6)
        (folder / "data").mkdir()
        make_dataset(folder / "target", folder / "data" / "prepared", n=96, max_length=256, block_size=8)

    folder = built_once(tmp_path_factory, "runtime_setup", build)
    return folder / "target", folder / "data" / "prepared"


@pytest.fixture(scope="session")
def reference(setup, tmp_path_factory):
    """1 target + 2 drafters, ZeRO-2, 20 uninterrupted steps, W&B offline; every tensor handed to
    torch.distributed audited as if the groups were the GPU ones (`out/audit`, distributed/audit.py). Returns the
    run folder and its torchrun's CompletedProcess (its output kept beside the folder for the other worker)."""
    target, data = setup

    def build(folder):
        out = folder / "ref"
        out.mkdir(parents=True)
        r = torchrun(3, [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out),
                         "--zero-stage", "2", "--wandb.enabled", "true"], cwd=out,
                     env={"DFLASH_DIST_AUDIT": str(out / "audit"), "DFLASH_DIST_AUDIT_AS": "nccl"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        (folder / "torchrun.json").write_text(json.dumps({"args": [str(a) for a in r.args], "stdout": r.stdout,
                                                          "stderr": r.stderr}))

    folder = built_once(tmp_path_factory, "runtime_reference", build)
    kept = json.loads((folder / "torchrun.json").read_text())
    return folder / "ref", subprocess.CompletedProcess(kept["args"], 0, kept["stdout"], kept["stderr"])
