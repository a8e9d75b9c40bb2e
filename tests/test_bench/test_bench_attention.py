"""`dflash-ds bench attention` runs as a user runs it and its JSON has the fields (CPU: dense backend); its table
and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "dflash_ds", "bench", "attention", *argv],
                          capture_output=True, text=True, env=env, timeout=240, check=False)


def test_bench_attention_json_and_table() -> None:
    proc = run_cli("--json", "--seq-len", "128", "--steps", "2", "--warmup", "1", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert (res["device"], res["dtype"], res["seq_len"], res["batch_size"]) == ("cpu", "fp32", 128, 2)
    assert res["num_anchors"] == 16 and res["block_size"] == 16
    (row,) = res["rows"]
    assert row["backend"] == "dense" and row["max_abs_diff_vs_first"] == 0.0
    assert row["step_ms"] > 0
    assert abs(row["tokens_per_s"] - 2 * 128 / (row["step_ms"] / 1e3)) / row["tokens_per_s"] < 0.01


def test_bench_attention_table_and_errors(cli_here) -> None:
    """The table, and one clear error per bad flag (in this process: the command's start is the test above's)."""
    table = cli_here("bench", "attention", "--seq-len", "64", "--steps", "1", "--warmup", "0")
    assert table.returncode == 0 and "tokens/s" in table.stdout and "dense" in table.stdout
    for argv, msg in ((["--backends", "flex"], "no backward on CPU"), (["--backends", "sparse"], "unknown backend"),
                      (["--seq-len", "8"], "must exceed --block-size")):
        proc = cli_here("bench", "attention", *argv)
        assert proc.returncode == 2 and msg in proc.stderr, (argv, proc.stderr)
