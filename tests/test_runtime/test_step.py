"""One drafter step for the trainer, `bench pipeline` and `dflash-ds train-step` (runtime/step.py), and one
target capture for target ranks, colocated ranks and bench (runtime/sources.capture_batch)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from conftest_runtime import COMMON


@pytest.fixture(scope="module")
def step_results(tiny_target, tmp_path_factory) -> dict:
    """_step_script.py's results: one process, world size 1, two DeepSpeed engines and a plain module."""
    from proc_utils import run_bounded
    from runtime_utils import REPO, env_for_children

    tmp = tmp_path_factory.mktemp("step")
    r = run_bounded([sys.executable, str(REPO / "tests/test_runtime/_step_script.py"), str(tiny_target),
                     str(tmp / "pg"), COMMON[1]], 180, env=env_for_children(), cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_step_is_the_trainers_step(step_results):
    """Same batch, batch id, step and initial weights: the bench's step loss and weights are the trainer's."""
    got = step_results
    assert got["has_last_hidden"] and got["noise"] > 0 and not got["skipped"], got  # KL and noise exercised
    assert math.isfinite(got["trainer_loss"]) and got["grad_norm"] > 0, got
    assert got["bench_loss"] == got["trainer_loss"], got
    assert got["weights_diff"] == 0.0, got


def test_train_step_tool_uses_the_trainers_forward(step_results):
    """`dflash-ds train-step`'s first step (plain module, step 0, noise off) has the trainer forward's loss."""
    got = step_results
    assert abs(got["tool_loss"] - got["forward0"]) <= 1e-6 * max(1.0, abs(got["forward0"])), got


@pytest.mark.parametrize("kl", [False, True])
def test_capture_into_a_send_buffer_equals_a_fresh_capture(tiny_target, kl: bool) -> None:
    """A target rank's capture (straight into a pooled send buffer) holds what a colocated rank's fresh one does."""
    import functools

    from dflash_ds.data.batching import BatchSpec, Cursor
    from dflash_ds.data.loader import Batch, collate
    from dflash_ds.distributed.bridge import AsyncSender
    from dflash_ds.distributed.wire import build_payload, payload_specs
    from dflash_ds.models.from_target import drafter_arch_from_target
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime.sources import capture_batch

    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=8)
    rows = {"input_ids": [[5, 6, 7], [8, 9, 10, 11, 12]], "loss_mask": [[0, 1, 1], [0, 0, 1, 1, 1]], "length": [3, 5]}
    spec = BatchSpec(index=0, bucket=0, sample_ids=[4, 9], real_tokens=8, padded_tokens=10)
    batch = Batch(*collate(rows, spec, pad_id=0), spec=spec, cursor=Cursor(0, 1))
    target = load_target(str(tiny_target))
    cpu = torch.device("cpu")
    fresh = capture_batch(target, batch, arch.target_layer_ids, kl, cpu)
    sender = AsyncSender(bridge=None)  # only its buffer pool is used here
    place = functools.partial(build_payload, sender, payload_specs(spec, arch, torch.float32, kl))
    pooled = capture_batch(target, batch, arch.target_layer_ids, kl, cpu, place=place)
    assert list(fresh) == list(pooled) == ["input_ids", "loss_mask", "lengths", "context"] + (["last_hidden"] if kl else [])
    for name in fresh:
        assert torch.equal(fresh[name], pooled[name]), name
