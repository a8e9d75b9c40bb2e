"""The feature cache (runtime/feature_cache.py): rows written, bounded, read back exactly, shared through the logs,
refused when the target or the data changes; and a colocated run with the cache trains as one without it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest_runtime import COMMON
from dflash_ds.errors import DFlashError
from dflash_ds.runtime.feature_cache import FeatureCache, check_key, data_fingerprint, target_fingerprint
from runtime_utils import make_dataset, per_batch, torchrun

LENGTHS = np.array([3, 5, 4])
K_H, H = 6, 2  # context width (layers x hidden) and final-hidden width of the toy rows


def toy(folder, rank=0, bound=10**9, last=H):
    folder.mkdir(exist_ok=True)
    return FeatureCache(folder, LENGTHS, K_H, last, bound, rank, write=True)


def batch(rows, width=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(len(rows), width, K_H, generator=g).to(torch.bfloat16)
    fin = torch.randn(len(rows), width, H, generator=g).to(torch.bfloat16)
    return ctx, fin


def test_rows_read_back_exactly_zero_past_their_length(tmp_path):
    cache = toy(tmp_path / "c")
    ctx, fin = batch([2, 0])
    assert not cache.has([2, 0])
    cache.store([2, 0], ctx, fin)
    assert cache.has([0, 2]) and not cache.has([0, 1])
    got_ctx, got_fin = cache.read([0, 2], width=6)
    assert torch.equal(got_ctx[0, :3], ctx[1, :3]) and torch.equal(got_ctx[1, :4], ctx[0, :4])
    assert torch.equal(got_fin[0, :3], fin[1, :3]) and torch.equal(got_fin[1, :4], fin[0, :4])
    assert not got_ctx[0, 3:].any() and not got_ctx[1, 4:].any() and not got_fin[0, 3:].any()
    # a token takes 2 x (6 + 2) bytes; row 2 starts after rows 0 and 1 (8 tokens)
    assert cache.token_bytes == 16 and list(cache.offsets) == [0, 48, 128]
    cache.close()


def test_the_bound_keeps_the_first_rows_that_fit(tmp_path):
    cache = toy(tmp_path / "c", bound=16 * 8 + 15)  # rows 0 and 1 (8 tokens); row 2 would end at 12 tokens
    assert cache.in_bound == 2 and cache.bound_bytes == 128
    ctx, fin = batch([0, 1, 2], width=5)
    cache.store([0, 1, 2], ctx, fin)
    assert cache.has([0, 1]) and not cache.has([2])
    assert (tmp_path / "c" / "features.bin").stat().st_size == 128  # nothing written past the bound
    cache.close()


def test_other_ranks_logs_count_and_a_torn_record_does_not(tmp_path):
    folder = tmp_path / "c"
    a, b = toy(folder, rank=0), toy(folder, rank=1)
    ctx, fin = batch([1])
    a.store([1], ctx, fin)
    assert b.has([1])  # read from rank 0's log at the miss
    assert torch.equal(b.read([1], 5)[0][0], ctx[0])
    with open(folder / "rows.1.log", "ab") as f:  # a rank killed mid-append: 3 bytes of a record
        f.write(b"\x02\x00\x00")
    resumed = toy(folder, rank=2)
    assert resumed.has([1]) and not resumed.has([2])
    for c in (a, b, resumed):
        c.close()


def test_an_fp32_targets_features_are_kept_exactly(tmp_path):
    """An fp32 run (a CPU without native bf16) caches fp32: 4 bytes a value, read back bit for bit."""
    folder = tmp_path / "c"
    folder.mkdir()
    cache = FeatureCache(folder, LENGTHS, K_H, 0, 10**9, 0, write=True, dtype=torch.float32)
    assert cache.token_bytes == 4 * K_H and list(cache.offsets) == [0, 72, 192]
    ctx = torch.randn(1, 4, K_H) * 1e-3 + 1.0  # values bf16 would round: 1 + 1e-3 is not a bf16
    cache.store([2], ctx, None)
    got, fin = cache.read([2], 4)
    assert fin is None and got.dtype == torch.float32 and torch.equal(got[0], ctx[0])
    assert not torch.equal(got[0], ctx[0].to(torch.bfloat16).float())
    assert "float32, 24 bytes a token" in cache.describe()
    cache.close()


def test_another_target_or_data_is_refused(tiny_target_factory, tmp_path):
    target = tiny_target_factory(layers=2)
    data = make_dataset(target, tmp_path / "data", n=16)
    key = {"version": 1, "target": target_fingerprint(target), "data": data_fingerprint([str(data)]),
           "target_layer_ids": [0, 1], "last_hidden": False}
    folder = tmp_path / "run" / "feature_cache"
    check_key(folder, key)
    check_key(folder, dict(key))  # the same run again (a resume): accepted
    assert json.loads((folder / "meta.json").read_text()) == key
    # the same weights copied elsewhere are the same target
    copy = tmp_path / "copy"
    shutil.copytree(target, copy)
    assert target_fingerprint(copy) == key["target"]
    # one weight changed (a fine-tune): another target
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] + 1e-2
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashError, match=r"train.feature_cache: .* holds the features of another run \(target: .*"
                                          r"the target folder's config or weights changed\); remove that folder"):
        check_key(folder, {**key, "target": target_fingerprint(copy)})
    other = make_dataset(target, tmp_path / "other", n=17)
    with pytest.raises(DFlashError, match=r"\(data: '[0-9a-f]+' there, '[0-9a-f]+' now: the prepared data changed"):
        check_key(folder, {**key, "data": data_fingerprint([str(other)])})
    with pytest.raises(DFlashError, match=r"target_layer_ids: \[0, 1\] there, \[1\] now"):
        check_key(folder, {**key, "target_layer_ids": [1]})
    # a cache an fp32 run wrote before its features were kept in fp32 (rounded to bf16) is not read as fp32
    old = {**key, "target_dtype": "float32", "stored_dtype": "bfloat16"}
    check_key(tmp_path / "old", old)
    with pytest.raises(DFlashError, match=r"stored_dtype: 'bfloat16' there, 'float32' now: the cache now keeps "
                                          r"features in the target's dtype"):
        check_key(tmp_path / "old", {**old, "stored_dtype": "float32"})


def _export(out, step):
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "export" / "model.safetensors"))


def test_a_cached_colocated_run_trains_as_an_uncached_one(setup, tmp_path):
    """One colocated rank in this CPU's fast dtype (bf16 where native, else fp32), 40 steps (~2.9 epochs of the 96
    rows): with the cache (null: on for a CPU run), stopped at step 25 and resumed, against the same run without
    it. The first epoch is the same computation; from the second the cached run reads the rows' features as the
    first epoch computed them, the other recomputes them in other batches (matmuls of another shape): losses
    within 2e-2 in bf16 (8 bits of mantissa on a loss of ~5), 1e-4 in fp32, the step-40 export likewise. A run on
    other data in the cached run's folder is refused, naming the data."""
    target, data = setup
    common = [*COMMON, "--target", str(target), "--data", str(data), "--no-wandb", "--colocate", "--max-steps", "40",
              "--train.dtype", "fast"]
    cached, plain = tmp_path / "cached", tmp_path / "plain"
    r = torchrun(1, [*common, "--output-dir", str(cached), "--train.stop_at", "25"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "feature cache: on (written in the first epoch, read from the second)" in r.stdout, r.stdout[-3000:]
    fp32 = "feature_cache, float32, " in r.stdout
    assert fp32 or "feature_cache, bfloat16, " in r.stdout, r.stdout[-3000:]
    tol = 1e-4 if fp32 else 2e-2
    r = torchrun(1, [*common, "--output-dir", str(cached), "--resume", "auto"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resuming from" in r.stdout and "read from" in r.stdout, r.stdout[-3000:]
    r = torchrun(1, [*common, "--output-dir", str(plain), "--train.feature_cache", "false"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert not (plain / "feature_cache").exists()
    got, want = per_batch(cached), per_batch(plain)
    assert sorted(got) == sorted(want) == list(range(40))
    assert want[39]["epoch_after"] >= 2  # the run reached its third epoch
    diffs = [abs(got[b]["loss"] - want[b]["loss"]) for b in want]
    assert max(diffs) < tol, diffs  # bit for bit on the CPU this was written on
    first = [b for b in want if want[b]["epoch_after"] == 0]
    assert all(got[b]["loss"] == want[b]["loss"] for b in first), diffs  # the first epoch: the same computation
    mine, theirs = _export(cached, 40), _export(plain, 40)
    assert max((mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs) < tol
    other = make_dataset(target, tmp_path / "other", n=40, max_length=256, block_size=8)
    r = torchrun(1, [*common, "--output-dir", str(cached), "--data", str(other), "--resume", "none"], cwd=tmp_path)
    assert r.returncode != 0 and "error: train.feature_cache:" in r.stderr, r.stderr[-3000:]
    assert "the prepared data changed (data.path / data.val_path)" in r.stderr, r.stderr[-3000:]
