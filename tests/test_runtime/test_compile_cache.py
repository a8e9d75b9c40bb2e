"""train.compile_cache (runtime/compile_cache.py): a process on a machine whose own compile cache is empty loads
what an earlier process saved into the run folder and compiles nothing; a file that cannot load is skipped.

Two processes, each with its own empty inductor cache folder (as two nodes have): the first compiles a fused
function and saves; the second, beside a torn file in the index, loads the first's file and hits it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtime_utils import env_for_children

SCRIPT = Path(__file__).with_name("_compile_cache_script.py")


def run(out: Path, rows: int, inductor: Path) -> tuple[dict, str]:
    env = {**env_for_children(), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), str(rows)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_fresh_machine_loads_the_runs_compiled_graphs(tmp_path):
    out = tmp_path / "run"
    first, _ = run(out, 64, tmp_path / "node0")
    assert first["loaded"] == [0, 0] and first["misses"] == 1 and first["saved"] == 2  # inductor's + AOT's
    assert abs(first["value"] - 2.0) < 1e-6
    index = json.loads((out / "compile_cache" / "index.json").read_text())
    (name, keys), = index.items()
    assert (out / "compile_cache" / name).stat().st_size > 0 and len(keys) == 2
    (out / "compile_cache" / "torn.bin").write_bytes(b"not an artifact")  # a torn copy, listed
    (out / "compile_cache" / "index.json").write_text(json.dumps({**index, "torn.bin": ["inductor/x"]}))
    second, err = run(out, 80, tmp_path / "node1")  # another row count: the same (dynamic) graph
    assert second["loaded"] == [1, 2] and second["hits"] == 1 and second["misses"] == 0
    assert second["saved"] == 0 and abs(second["value"] - 2.0) < 1e-6  # nothing new: no file written
    assert "compile cache" in err and "torn.bin not loaded" in err and "compile again" in err
    assert sorted(p.name for p in (out / "compile_cache").iterdir()) == sorted([name, "torn.bin", "index.json"])
