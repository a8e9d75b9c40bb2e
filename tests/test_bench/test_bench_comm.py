"""`dflash-ds bench comm` under torchrun on 2 ranks (1 target + 1 drafter, gloo): it runs, the JSON has its fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
from runtime_utils import bench_torchrun  # noqa: E402



def test_bench_comm_json() -> None:
    r = bench_torchrun(2, ["comm", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1", "--feature-dim", "64",
                           "--rounds", "3", "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])  # rank 0 (a drafter) prints one JSON line
    assert result["backend"] == "gloo"
    assert result["layout"] == {"targets": [1], "drafters": [0]}
    rows = result["results"]
    assert [(x["size"], x["kind"]) for x in rows] == [(4096, "raw"), (4096, "exchange"), (65536, "raw"),
                                                     (65536, "exchange")]
    for x in rows:
        assert (x["src"], x["dst"]) == (1, 0)
        assert x["time_us"] > 0 and x["algbw_gbs"] > 0
        assert x["algbw_gbs"] * 1e9 * x["time_us"] / 1e6 == pytest.approx(x["bytes"], rel=1e-6)
        assert len(x["rounds_us"]) == 3 and x["time_us"] == sorted(x["rounds_us"])[1]  # the median round
    assert rows[0]["bytes"] == 4096
    assert 0.5 * 65536 < rows[3]["bytes"] <= 65536  # a training-shaped dict of about the requested size
    assert [x["size"] for x in result["ratio"]] == [4096, 65536] and all(x["ratio"] > 0 for x in result["ratio"])


def test_bench_comm_table() -> None:
    r = bench_torchrun(2, ["comm", "--sizes", "64K", "--iters", "1", "--warmup", "0"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "target rank 1 -> drafter rank 0" in r.stdout and "exch/raw" in r.stdout and "algbw (GB/s)" in r.stdout
    bad = bench_torchrun(2, ["comm", "--rounds", "0"])
    assert bad.returncode != 0 and "--rounds must be >= 1" in bad.stderr
