"""`dflash-ds train-step`: the single-device core trains (the loss falls on a fixed batch)."""

import re
import subprocess
import sys

import pytest
import torch

from dflash_ds.tools.init_drafter import init_drafter


def train_step(target, drafter, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ds", "train-step", "--target", str(target), "--drafter",
                           str(drafter), "--steps", "4", "--batch", "2", *extra],
                          capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", "fp32"),
    pytest.param("cuda", "bf16", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_train_step_loss_falls(tiny_target, tmp_path, device, dtype):
    init_drafter(tiny_target, tmp_path / "d", num_layers=2, block_size=8)
    proc = train_step(tiny_target, tmp_path / "d", "--device", device, "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4, proc.stdout
    assert losses[-1] < losses[0], losses  # same batch, lr 3e-3: the fit improves


def test_train_step_cuda_without_gpu_is_an_error(tiny_target, tmp_path, cli_here):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    init_drafter(tiny_target, tmp_path / "d", num_layers=2, block_size=8)
    proc = cli_here("train-step", "--target", tiny_target, "--drafter", tmp_path / "d", "--device", "cuda")
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr
