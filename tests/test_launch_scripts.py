"""Every launch script parses (`bash -n`), and the prepared GPU checks say what their summary holds.

The GPU checks themselves run end to end with DEVICE=cpu (minutes: not part of the suite); their
figures and the commands are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


@pytest.mark.parametrize("script", sorted(p.name for p in [*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")]))
def test_script_parses(script: str) -> None:
    r = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script,fields", [
    ("gpu_check.sh", ["compiled_graphs", "peak_mem_gb", "reserved_mem_gb", "tok_per_sec", "mfu", "summary.json",
                      "table.md", "real-shape", "--profile", "HF_HUB_OFFLINE", ".whl"]),
    ("gpu_check_2gpu.sh", ["summary.json", "resume_max_dloss", "exitcode  : 75"]),
])
def test_gpu_checks_summarise_what_they_measure(script: str, fields: list[str]) -> None:
    text = (LAUNCH / script).read_text() + (
        (LAUNCH / "gpu_summary.py").read_text() if script == "gpu_check.sh" else "")
    assert all(f in text for f in fields), [f for f in fields if f not in text]
    assert "DEVICE=cpu" in text and "PYTORCH_CUDA_ALLOC_CONF" in text  # runnable on a CPU box; allocator set


def test_launch_scripts_set_expandable_segments() -> None:
    for name in ("train.sh", "train_multinode.sh", "train_deepspeed.sh", "gpu_colocated.sh"):
        assert "expandable_segments:True" in (LAUNCH / name).read_text(), name


def test_slurm_script_stops_on_a_refused_secret(tmp_path: Path) -> None:
    """A secret the credentials helper refuses (a carriage return in it) ends the batch script there, with the
    helper's status, before anything reaches SLURM: `eval "$(helper)"` would have gone on (eval of "" is 0)."""
    import os
    import sys

    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(tmp_path), "NPROC": "1",
           "DFLASH_LAUNCH_DIR": str(LAUNCH), "WANDB_API_KEY": "wb\rDFLASH_X=evil",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(LAUNCH / "train_slurm.sbatch")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "WANDB_API_KEY" in r.stderr and "carriage return" in r.stderr
    assert "scontrol" not in r.stderr and "wb\r" not in r.stderr  # stopped before the rendezvous host; no value shown
