"""`dflash-ds bench fuse`: each train.fuse function timed eager and compiled (inductor on CPU), at small rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_ds.components import fusion
from dflash_ds.runtime.memory import compiled_graphs


def test_bench_fuse_times_each_function_both_ways(cli_here, tmp_path: Path) -> None:
    out = tmp_path / "fuse.json"
    before, graphs = fusion.FUSION.mode, compiled_graphs()
    torch._dynamo.reset()  # nothing compiled earlier in this process serves these shapes
    res = cli_here("bench", "fuse", "--rows", "64", "--repeats", "1", "--only", "RMSNorm,SwiGLU,dflash2",
                   "--json", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["RMSNorm [64 x 4096]", "SwiGLU [64 x 12288]",
                                         "dflash2 conv [64 x 4096, 2 taps, 64 groups]"]
    for r in rows:
        assert r["eager_s"] > 0 and r["fused_s"] > 0 and r["speedup"] == pytest.approx(r["eager_s"] / r["fused_s"])
    assert "speed-up" in res.stdout and fusion.FUSION.mode == before  # the mode it found, restored
    assert compiled_graphs() - graphs >= 3  # the fused rows ran compiled (the normalisation, SwiGLU, conv)
    bad = cli_here("bench", "fuse", "--only", "GELU")
    assert bad.returncode != 0 and "--only 'GELU' names no case" in bad.stderr
