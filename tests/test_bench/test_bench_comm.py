"""`dflash-ds bench comm` under torchrun on 2 ranks (1 target + 1 drafter, gloo): it runs, the JSON has its fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
from runtime_utils import REPO, bench_torchrun  # noqa: E402


def test_bench_comm_json_with_a_training_batch_of_a_config(tiny_target: Path) -> None:
    """The JSON's fields, and --config's extra row: one full batch of that run, token budget x (selected layers +
    final hidden if KL) x dtype + ids."""
    from dflash_ds.models.from_target import drafter_arch_from_target

    r = bench_torchrun(2, ["comm", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1", "--feature-dim", "64",
                           "--rounds", "3", "--config", str(REPO / "configs/tiny.yaml"), "--set", f"target={tiny_target}",
                           "--set", "data.token_budget=512", "--set", "loss.kl_weight=0.5", "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])  # rank 0 (a drafter) prints one JSON line
    assert result["backend"] == "gloo"
    assert result["layout"] == {"targets": [1], "drafters": [0]}
    rows = [x for x in result["results"] if not x["training_batch"]]
    assert [(x["size"], x["kind"]) for x in rows] == [(4096, "raw"), (4096, "exchange"), (65536, "raw"),
                                                     (65536, "exchange")]
    for x in result["results"]:
        assert (x["src"], x["dst"]) == (1, 0)
        assert x["time_us"] > 0 and x["algbw_gbs"] > 0
        assert x["algbw_gbs"] * 1e9 * x["time_us"] / 1e6 == pytest.approx(x["bytes"], rel=1e-6)
        assert len(x["rounds_us"]) == 3 and x["time_us"] == sorted(x["rounds_us"])[1]  # the median round
    assert rows[0]["bytes"] == 4096
    assert 0.5 * 65536 < rows[3]["bytes"] <= 65536  # a training-shaped dict of about the requested size

    arch = drafter_arch_from_target(tiny_target, num_layers=2, block_size=8)
    k, h = len(arch.target_layer_ids), arch.hidden_size
    per_token = (k * h + h) * 4 + 16  # fp32 on CPU: context + final hidden (KL on), int64 ids and mask
    t = result["training_batch"]
    assert (t["feature_dim"], t["last_dim"], t["dtype"], t["token_budget"]) == (k * h, h, "float32", 512)
    assert t["bytes_per_token"] == per_token and t["bytes"] == 512 * per_token
    marked = [x for x in result["results"] if x["training_batch"]]
    assert [(x["size"], x["kind"]) for x in marked] == [(512 * per_token, "raw"), (512 * per_token, "exchange")]
    exchange = marked[1]
    assert exchange["bytes"] == t["bytes"] + 8  # one row of 512 tokens: the batch's tensors plus its int64 length
    sizes = sorted([4096, 65536, 512 * per_token])  # the ratio rows, in size order; the config's is marked
    assert [x["size"] for x in result["ratio"]] == sizes and all(x["ratio"] > 0 for x in result["ratio"])
    assert [x["training_batch"] for x in result["ratio"]] == [s == 512 * per_token for s in sizes]


def test_bench_comm_table() -> None:
    r = bench_torchrun(2, ["comm", "--sizes", "64K", "--iters", "1", "--warmup", "0"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "target rank 1 -> drafter rank 0" in r.stdout and "exch/raw" in r.stdout and "algbw (GB/s)" in r.stdout


def test_bench_comm_errors_come_before_any_group(cli_here, monkeypatch) -> None:
    """Rank 0 of a 2-rank launch (its environment, in this process): a bad flag or config ends it before it joins
    a group."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    bad = cli_here("bench", "comm", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr, bad.stderr
    bad = cli_here("bench", "comm", "--sizes", "4K", "--config", REPO / "configs/tiny.yaml", "--set",
                   "target=/nonexistent/target")
    assert bad.returncode == 2 and "/nonexistent/target" in bad.stderr, bad.stderr
