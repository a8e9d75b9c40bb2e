"""A full disk or an unwritable run folder: one clear error, and the previous checkpoint stays `latest`."""

from __future__ import annotations

import subprocess

import pytest
import torch.distributed as dist

from dflash_ds.errors import DFlashError
from dflash_ds.runtime import checkpoint as ckpt


class FillingEngine:
    """Stands in for the DeepSpeed engine's shard writer: writes more than the disk holds."""

    def save_checkpoint(self, folder: str, tag: str, client_state: dict | None = None) -> None:
        with open(f"{folder}/{tag}.bin", "wb") as f:
            f.write(b"\0" * (1 << 20))


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (real ENOSPC from the kernel); skipped where mounting is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_disk_full_during_save_keeps_previous_checkpoint(small_disk, single_rank_group):
    out = small_disk / "run"
    root = ckpt.checkpoint_root(out)
    prev = ckpt.step_dir(root, 10)
    prev.mkdir(parents=True)
    (prev / ckpt.STATE).write_text('{"step": 10}')
    (prev / ckpt.COMPLETE).write_text("10\n")
    (root / ckpt.LATEST).write_text(prev.name + "\n")
    with pytest.raises(DFlashError) as err:
        ckpt.save_checkpoint(FillingEngine(), 20, out, {"step": 20}, keep_last=3, export_fn=lambda folder: None)
    assert "checkpoint at step 20 failed: No space left on device" in str(err.value)
    assert "the previous checkpoint is intact" in str(err.value)
    assert ckpt.find_latest(out) == prev
    assert not ckpt.step_dir(root, 20).exists()
    assert ckpt.resolve_resume("auto", out) == prev


def test_unwritable_output_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DFlashError, match="output folder .* is not writable"):
        ckpt.check_writable(blocker / "run")
