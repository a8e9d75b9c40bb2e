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


def test_report_draws_the_acceptance_figures_together(tmp_path):
    from PIL import Image

    recs = _records()
    for i, r in enumerate(recs):
        r["est_tau"] = 1.0 + 0.05 * i
        r["alpha_tau"] = 1.5 + 0.01 * i
        if i % 5 == 4:  # validation every 5th record; its best is at step 150
            r["val_est_tau"] = {4: 1.2, 9: 1.4, 14: 1.9, 19: 1.7}[i]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["report", "--run", str(tmp_path)]) == 0
    png = tmp_path / "plots" / "acceptance.png"
    with Image.open(png) as img:
        raw = img.convert("RGB").tobytes()
    pixels = [c for c in zip(raw[0::3], raw[1::3], raw[2::3]) if max(c) - min(c) > 60]  # coloured: not text, grid
    cycle = {"tau": (31, 119, 180), "est_tau": (255, 127, 14), "val_est_tau": (44, 160, 44), "alpha_tau": (214, 39, 40)}
    nearest = [min(cycle, key=lambda k: sum((a - b) ** 2 for a, b in zip(c, cycle[k]))) for c in pixels]
    assert all(nearest.count(k) > 50 for k in cycle), {k: nearest.count(k) for k in cycle}  # four curves drawn
    summary = (tmp_path / "plots" / "summary.txt").read_text()
    assert "val_est_tau          first 1.2 (step 50)  last 1.7 (step 200)  best 1.9 (step 150)" in summary
    last10 = sum(1.0 + 0.05 * i for i in range(10, 20)) / 10  # 1.725
    assert f"est_tau              first 1 (step 10)  last 1.95 (step 200)  best 1.95 (step 200)  mean of last 10 " \
           f"{last10:.4g}" in summary
    assert "est_tau (val_est_tau on held-out rows) predicts" in summary


def test_report_without_estimates_draws_no_acceptance_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert main(["report", "--run", str(tmp_path)]) == 0
    assert not (tmp_path / "plots" / "acceptance.png").exists()
    assert "predicts" not in (tmp_path / "plots" / "summary.txt").read_text()
