"""`dflash-ds bench pipeline` on 1 target + 1 drafter (torchrun, gloo, the tiny target): it runs, the JSON has its fields.

No timing asserts: speed lives in docs/BENCHMARKS.md. What is asserted is that the four
phases measured the same batches and that the figures are derived as documented.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
from runtime_utils import REPO, bench_torchrun, make_dataset  # noqa: E402



def test_bench_pipeline_json(tiny_target_factory, tmp_path: Path) -> None:
    target = tiny_target_factory(layers=4)
    data = make_dataset(target, tmp_path / "prepared", n=64, max_length=256, block_size=8)
    out = tmp_path / "scratch"
    r = bench_torchrun(2, ["pipeline", "--target", str(target), "--data", str(data), "--config",
                           str(REPO / "configs/tiny.yaml"), "--set", "data.token_budget=1024", "--set",
                           "loss.num_anchors=8", "--steps", "6", "--warmup-steps", "2", "--output-dir", str(out),
                           "--timeout-s", "120", "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    c = res["config"]
    assert (c["num_target_ranks"], c["num_drafter_ranks"], c["target_layers"], c["drafter_layers"]) == (1, 1, 4, 2)
    assert (c["steps"], c["warmup_steps"], c["backend"], c["threads_per_rank"]) == (6, 2, "gloo", 1)
    a, b, p, d = res["target_capacity"], res["drafter_capacity"], res["pipeline"], res["colocated"]
    for phase in (a, b, p, d):
        assert phase["tok_per_s"] > 0 and phase["tokens"] > 0 and phase["seconds"] > 0
        assert phase["tok_per_s"] == pytest.approx(phase["tokens"] / phase["seconds"])
    # (a), (b) and the trainer's timed windows covered the same batches (steps 2..5 of drafter 0)
    assert a["tokens"] == b["tokens"] == p["tokens"]
    assert d["ranks"] == 2 and a["ranks"] == b["ranks"] == 1
    serial = res["colocated_serial"]  # one worker, both stages in series, the same batches as the pipeline
    assert serial["ranks"] == 1 and serial["tokens"] == p["tokens"]
    assert res["speedup_serial"] == pytest.approx(p["tok_per_s"] / serial["tok_per_s"])
    assert res["efficiency"] == pytest.approx(p["tok_per_s"] / min(a["tok_per_s"], b["tok_per_s"]))
    assert res["speedup"] == pytest.approx(p["tok_per_s"] / d["tok_per_s"])
    assert res["target_over_drafter"] == pytest.approx(a["tok_per_s"] / b["tok_per_s"])
    assert set(res["phase_wall_s"]) == {"d", "setup", "ab", "c"}
    assert c["stage_timing"] == "one after the other"
    for key in ("efficiency_median", "speedup_median", "speedup_serial_median"):
        assert res[key] > 0
    assert all(phase["tok_per_s_median"] > 0 for phase in (a, b, p, d))
    assert (out / "metrics.jsonl").is_file()  # phase (c) was the trainer itself
