"""`dflash-ds report`: PNGs and summary from a synthetic metrics.jsonl."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from dflash_ds.cli import main

PLOTTED = ("loss", "accuracy", "tau", "tok_per_sec", "hs_queue_depth", "padding_efficiency")


def _records(n: int = 20) -> list[dict]:
    return [{"step": 10 * (i + 1), "loss": 5.0 * math.exp(-i / 8), "accuracy": 0.1 + 0.03 * i, "tau": 1.0 + 0.1 * i,
             "tok_per_sec": 1000.0 + 10 * (i % 3), "hs_queue_depth": float(i % 4), "padding_efficiency": 0.95,
             "bucket_pct": {"0-512": 50.0, "512-1024": 50.0}} for i in range(n)]


def test_report_writes_pngs_and_summary(tmp_path):
    from PIL import Image

    recs = _records()
    lines = [json.dumps(r) for r in recs]
    lines.insert(5, '{"step": 55, "loss": ')  # a torn line (crash mid-write) is skipped, not fatal
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "dflash_ds", "report", "--run", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for key in PLOTTED:
        png = tmp_path / "plots" / f"{key}.png"
        assert png.is_file(), key
        with Image.open(png) as img:
            assert img.size[0] > 0 and img.size[1] > 0
            lo_hi = img.convert("L").getextrema()
            assert lo_hi[0] != lo_hi[1], f"{key}.png is a single colour"
    summary = (tmp_path / "plots" / "summary.txt").read_text()
    assert "steps: 10 .. 200 (20 records)" in summary
    assert "loss                 first 5 (step 10)" in summary
    assert f"best {recs[-1]['loss']:.4g} (step 200)" in summary  # loss is best at its minimum
    assert "tau                  first 1 (step 10)  last 2.9 (step 200)  best 2.9 (step 200)" in summary
    assert "skipped 1 unreadable line" in summary
    assert summary.strip() in proc.stdout


def test_report_missing_or_empty_metrics_names_the_file(tmp_path, capsys):
    assert main(["report", "--run", str(tmp_path)]) == 2
    assert str(tmp_path / "metrics.jsonl") in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert main(["report", "--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err and "no metric records" in err
