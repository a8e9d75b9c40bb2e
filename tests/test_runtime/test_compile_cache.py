"""train.compile_cache (runtime/compile_cache.py): a process on a machine whose own compile cache is empty loads
what an earlier process saved into the run folder and compiles nothing; a file that cannot load is skipped.

This process compiles a fused function and saves; a second one, with an empty inductor cache folder of its own (as
another node has) and a torn file beside the first's in the index, loads the first's file and hits it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from dflash_ds.components import fusion
from dflash_ds.models import layer_ops
from dflash_ds.runtime import compile_cache
from runtime_utils import env_for_children

SCRIPT = Path(__file__).with_name("_compile_cache_script.py")


def test_a_fresh_machine_loads_the_runs_compiled_graphs(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(fusion.FUSION, "mode", "on")
    with torch.no_grad():  # the script's function: an RMSNorm over [rows x 96], forward only
        y = layer_ops.rms_norm(torch.ones(64, 96), torch.full((96,), 2.0), 1e-6)
    assert abs(float(y.mean()) - 2.0) < 1e-6
    written = compile_cache.save(out)  # everything this process compiled, the RMSNorm's graphs among them
    index = json.loads((out / "compile_cache" / "index.json").read_text())
    (name, keys), = index.items()
    assert written == len(keys) >= 2 and (out / "compile_cache" / name).stat().st_size > 0
    assert compile_cache.save(out) == 0  # nothing new: nothing written
    (out / "compile_cache" / "torn.bin").write_bytes(b"not an artifact")  # a torn copy, listed
    (out / "compile_cache" / "index.json").write_text(json.dumps({**index, "torn.bin": ["inductor/x"]}))
    # the same thread count as this process: inductor's CPU kernels are keyed by it (a job's ranks share one)
    env = {**env_for_children(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "node1"),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "80"], capture_output=True, text=True, env=env,
                       timeout=300)  # another row count: the same (dynamic) graph
    assert r.returncode == 0, r.stderr[-3000:]
    second = json.loads(r.stdout.strip().splitlines()[-1])
    assert second["loaded"] == [1, len(keys)] and second["hits"] == 1 and second["misses"] == 0
    assert abs(second["value"] - 2.0) < 1e-6
    assert "compile cache" in r.stderr and "torn.bin not loaded" in r.stderr and "compile again" in r.stderr
