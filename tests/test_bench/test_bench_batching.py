"""`dflash-ds bench batching` end to end, as a user runs it (a subprocess), and its table and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    # PYTHONPATH makes the checkout importable even before `pip install -e .`.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "dflash_ds", "bench", "batching", *argv],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )


def test_bench_batching_json() -> None:
    proc = run_cli("--json", "--num-samples", "5000")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["config"]["num_samples"] == 5000
    assert result["config"]["boundaries"] == [128, 256, 512, 1024, 2048, 4096]
    for name in ("bucketed", "bucketed_unsorted", "random_pad_to_longest", "random_token_budget"):
        for key in ("padding_efficiency", "num_batches", "batches_per_sec", "longest_same_bucket_run"):
            assert key in result[name], (name, key)
        assert 0 < result[name]["padding_efficiency"] <= 1
    ours, random4 = result["bucketed"], result["random_pad_to_longest"]
    assert ours["padding_efficiency"] >= 0.95  # docs/DESIGN.md §5: sorting inside buckets, ~0.999 at 50k samples
    assert ours["padding_efficiency"] > random4["padding_efficiency"]
    assert ours["longest_same_bucket_run"] <= 3
    assert ours["max_padded_tokens"] <= 16384
    assert random4["num_batches"] == 5000 // 4 and random4["longest_same_bucket_run"] is None
    assert sum(ours["bucket_num_batches"]) == ours["num_batches"]


def test_bench_batching_table_and_errors(cli_here) -> None:
    # In this process: the command's start is the test above's.
    proc = cli_here("bench", "batching", "--num-samples", "2000", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    assert "bucketed, sorted (ours)" in proc.stdout and "random, batch of 4" in proc.stdout
    bad = cli_here("bench", "batching", "--max-length", "4096", "--token-budget", "1000")
    assert bad.returncode == 2 and "must be <= --token-budget" in bad.stderr
