"""A full disk or an unwritable run folder: one clear error, and the previous checkpoint stays `latest`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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


class ShardEngine:
    """Stands in for the DeepSpeed engine's shard writer: one 20 MiB shard (sampled by the manifest) and a small
    one, seeded bytes."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def save_checkpoint(self, folder: str, tag: str, client_state: dict | None = None) -> None:
        import random

        rng = random.Random(self.seed)
        (Path(folder) / tag).mkdir()
        (Path(folder) / tag / "big_states.pt").write_bytes(rng.randbytes(20 << 20))
        (Path(folder) / tag / "small_states.pt").write_bytes(rng.randbytes(1000))


def test_a_checkpoint_that_fails_its_manifest_is_passed_over_and_refused_by_path(tmp_path, single_rank_group):
    """Every file of a save is in its manifest (size, sampled digest); a newest checkpoint cut short or with bytes
    zeroed inside a sample is passed over by --resume auto (named, with the file) for the previous one, refused
    when named; a checkpoint without a manifest (older) is taken as it is; `ckpt info` says which."""
    from dflash_ds.runtime.checkpoint_manifest import MANIFEST, check_manifest
    from dflash_ds.runtime.resume import manifest_status

    out = tmp_path / "run"
    for step in (10, 20):
        ckpt.save_checkpoint(ShardEngine(step), step, out, {"step": step}, keep_last=3,
                             export_fn=lambda folder: (folder.mkdir(), (folder / "config.json").write_text("{}")))
    old, new = (ckpt.step_dir(ckpt.checkpoint_root(out), s) for s in (10, 20))
    listed = json.loads((new / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["ds/big_states.pt", "ds/small_states.pt", "export/config.json"]  # the state: parsed
    assert listed["ds/big_states.pt"]["size"] == 20 << 20
    assert check_manifest(new) is None and ckpt.resolve_resume("auto", out) == new
    big = new / "ds/big_states.pt"
    intact = big.read_bytes()
    for how, broken in (("cut short", intact[: 19 << 20]), ("its bytes changed", bytes(4096) + intact[4096:])):
        big.write_bytes(broken)
        said = []
        assert ckpt.resolve_resume("auto", out, log=said.append) == old, how
        assert len(said) == 1 and str(big) in said[0] and how in said[0], said
        with pytest.raises(DFlashError, match=f"fails its manifest: {big}"):
            ckpt.resolve_resume(str(new), out)
        assert manifest_status(new).startswith(f"FAILS: {big}")
    big.write_bytes(intact)  # restored: the newest again
    assert ckpt.resolve_resume("auto", out) == new and manifest_status(new).startswith("intact")
    state = (new / ckpt.STATE).read_text()
    (new / ckpt.STATE).write_text(state[:5])  # a state cut short: passed over too
    said = []
    assert ckpt.resolve_resume("auto", out, log=said.append) == old and "trainer_state.json is unreadable" in said[0]
    (new / ckpt.STATE).write_text(state)
    (new / MANIFEST).unlink()  # as a checkpoint written before manifests: taken as it is
    big.write_bytes(intact[:100])
    assert ckpt.resolve_resume("auto", out) == new and manifest_status(new).startswith("none")


def test_sync_tree_passes_over_what_another_rank_moves_meanwhile(tmp_path):
    """Every drafter rank fsyncs the whole save folder while rank 0 may still write its export there (a temporary
    folder renamed into place, as tools/init_drafter.save_atomically does): a file gone between the listing and
    its fsync is passed over, not an error that fails the save (seen in the chaos soak: rank 1's save failed with
    ENOENT on the partial checkpoint while rank 0 exported)."""
    import os
    import shutil
    import threading
    import time

    from dflash_ds.runtime.checkpoint_manifest import sync_tree

    folder = tmp_path / "step_00000012.partial"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "shard.pt").write_bytes(b"x" * 4096)
    done, moves = threading.Event(), [0]

    def export_again_and_again():
        while not done.is_set():
            tmp = folder / f".export.tmp{moves[0]}"
            tmp.mkdir()
            for i in range(16):
                (tmp / f"part{i}").write_bytes(b"y" * 512)
            shutil.rmtree(folder / "export", ignore_errors=True)
            os.rename(tmp, folder / "export")
            moves[0] += 1

    writer = threading.Thread(target=export_again_and_again)
    writer.start()
    syncs, deadline = 0, time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            sync_tree(folder)
            syncs += 1
    finally:
        done.set()
        writer.join()
    assert syncs > 10 and moves[0] > 10, (syncs, moves)
