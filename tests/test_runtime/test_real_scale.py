"""Real-scale settings on CPU: a real vocabulary fits through the chunked loss and the anchor budget,
every tensor handed to torch.distributed suits the GPU backend of its group, metrics say what a step
trained on, and resume stays exact with a binding anchor budget."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest_runtime import COMMON
from proc_utils import run_bounded_peak_rss, spare_threads
from runtime_utils import REPO, env_for_children, free_port, make_dataset, read_jsonl, torchrun

QWEN3_VOCAB = 151_936
GIB = 1024 ** 3


def test_device_placement_audit(reference):
    """The reference run (1 target + 2 drafters, checkpoints at 10 and 20), audited: every dflash_ds call
    passes tensors the GPU groups carry."""
    out, _ = reference
    audit = out / "audit"
    reports = {p.stem: json.loads(p.read_text()) for p in audit.glob("rank*.json")}
    assert sorted(reports) == ["rank0", "rank1", "rank2"]
    for name, rep in reports.items():
        assert rep["emulated_backend"] == "nccl"
        assert rep["violations"] == [], (name, rep["violations"][:3])
        assert rep["calls"].get("bridge/dflash_ds", 0) > 0, (name, rep["calls"])
    for drafter in ("rank0", "rank1"):  # the per-step flags and the metric window: 4 + 2 all-reduces at least
        assert reports[drafter]["calls"].get("role/dflash_ds", 0) >= 6, reports[drafter]["calls"]
        assert reports[drafter]["calls"].get("role/trusted", 0) > 0  # DeepSpeed's own, counted


def test_audit_catches_a_host_tensor_on_an_nccl_only_group(tmp_path, monkeypatch):
    """What the audit reports for the bug it exists for: the metric reduce on a group without a CPU backend."""
    import torch.distributed as dist

    from dflash_ds.distributed import audit, topology
    from dflash_ds.runtime.step_metrics import MetricWindow

    monkeypatch.setenv(audit.ENV, str(tmp_path))
    monkeypatch.setitem(topology.ROLE_BACKENDS, "nccl", "nccl")  # the role groups before this fix
    originals = {name: getattr(dist, name) for name in audit.COLLECTIVES if hasattr(dist, name)}
    monkeypatch.setattr(audit, "_state", {"calls": {}, "violations": [], "installed": False})
    monkeypatch.setattr(audit, "_write", lambda *a: None)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        audit.install(object(), torch.device("cpu"))
        window = MetricWindow(num_buckets=2, num_positions=3, num_drafters=1, drafter=0)
        window.reduce()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
    (v,) = audit._state["violations"]
    assert v["op"] == "all_reduce" and v["group_devices"] == ["cuda"] and v["would_be"] == "cpu"
    assert "step_metrics.py" in v["at"]


@pytest.mark.timeout(900)
def test_real_vocabulary_fits_with_chunks_and_anchor_budget(tiny_target_factory, tmp_path):
    """The run that was OOM-killed at 23 GiB: Qwen3's vocabulary, 512 anchors per sequence, KL 0.5,
    a 2,048-token budget, 1 target + 1 drafter, one step of 400 anchors (the budget binds: up to 6,400 label
    positions, whose unchunked loss would need over 24 GB; about 40 s of CPU at this vocabulary, the suite's budget).
    Every rank stays under 12 GiB resident."""
    target = tiny_target_factory(layers=4, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128,
                                 vocab_size=QWEN3_VOCAB)
    data = make_dataset(target, tmp_path / "prepared", n=64, max_length=256, block_size=16)
    out = tmp_path / "run"
    args = ["--config", str(REPO / "configs/tiny.yaml"), "--target", str(target), "--data", str(data),
            "--output-dir", str(out), "--max-steps", "1", "--train.log_interval", "1", "--model.block_size", "16",
            "--loss.num_anchors", "512", "--loss.kl_weight", "0.5", "--data.token_budget", "2048",
            "--train.timeout_s", "300", "--loss.max_anchors_per_batch", "400"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "dflash_ds.train", *args]
    # Two threads when the test has both cores: the target rank is idle once it has sent its batch.
    r, peaks = run_bounded_peak_rss(cmd, 600, env={**env_for_children(), "OMP_NUM_THREADS": str(spare_threads())},
                                    cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(peaks) >= 3  # the launcher and its two ranks were sampled
    max_rss = max(peaks.values())
    records = read_jsonl(out / "metrics.jsonl")
    assert [rec["step"] for rec in records] == [1]
    for rec in records:
        assert rec["label_positions"] >= 5000, rec["label_positions"]
        assert rec["anchors"] <= 400  # the budget per micro-batch (one drafter)
        assert 0 < rec["peak_mem_gb"] < 12
        # What the same step needs unchunked: 32.5 bytes per (label position x vocabulary entry) with KL.
        assert rec["label_positions"] * QWEN3_VOCAB * 32.5 >= 24e9
    assert max_rss < 12 * GIB, f"largest rank peaked at {max_rss / GIB:.1f} GiB"
    print(f"largest rank peak RSS {max_rss / GIB:.2f} GiB; label positions per step "
          f"{[rec['label_positions'] for rec in records]}; peak_mem_gb {[rec['peak_mem_gb'] for rec in records]}")


def test_binding_anchor_budget_resumes_bit_exactly(setup, tmp_path):
    """With max_anchors_per_batch binding on every batch, a staged run equals an uninterrupted one
    (ZeRO-3, activation checkpointing on for the first layer of two, the second keeping its activations: the
    frozen head never enters ZeRO's partitioning). One colocated rank: under ZeRO-3 too, the head it shares with
    its loaded target stays whole."""
    target, data = setup
    extra = ["--loss.max_anchors_per_batch", "40", "--max-steps", "6", "--train.save_interval", "3",
             "--train.log_interval", "3", "--model.activation_checkpointing", "true", "--model.checkpoint_layers", "1",
             "--zero-stage", "3", "--colocate"]
    full, staged = tmp_path / "full", tmp_path / "staged"
    r = torchrun(1, [*COMMON, *extra, "--target", str(target), "--data", str(data), "--output-dir", str(full)],
                 cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "activation checkpointing model.activation_checkpointing = true, model.checkpoint_layers = 1 of 2" in \
        r.stdout + r.stderr, r.stdout[-3000:]
    for stop_at in ("3", "0"):
        r = torchrun(1, [*COMMON, *extra, "--target", str(target), "--data", str(data), "--output-dir", str(staged),
                         "--train.stop_at", stop_at], cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    a = read_jsonl(full / "records" / "drafter0.jsonl")
    b = read_jsonl(staged / "records" / "drafter0.jsonl")
    assert [x["batch_id"] for x in a] == [x["batch_id"] for x in b] == list(range(6))
    assert [x["loss"] for x in a] == [x["loss"] for x in b]  # bit-exact
    recs = read_jsonl(full / "metrics.jsonl")
    assert all(rec["anchors"] == 40 for rec in recs), [rec["anchors"] for rec in recs]
