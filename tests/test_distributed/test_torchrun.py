"""`python -m dflash_ds.distributed.torchrun` (launch/train.sh, train_multinode.sh): torchrun whose agents' stores
listen on one address. The two-host runs (tests/test_runtime/test_multihost_train.py, test_slurm.py) check every
socket of a whole job with `ss`; this is the one-host case, --standalone, in a few seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A rank: the job's store as the trainer opens it, then every listening socket of this rank and of its agent.
RANK = """import datetime, os, subprocess, time
from dflash_ds.distributed.store import job_store
os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")
store = job_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                  int(os.environ["WORLD_SIZE"]), datetime.timedelta(seconds=60), True)
if os.environ["RANK"] == "0":
    mine = (f"pid={os.getpid()},", f"pid={os.getppid()},")
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    print("LISTEN", " ".join(sorted(line.split()[3] for line in lines if any(p in line for p in mine))), flush=True)
store.add("done", 1)
while store.add("done", 0) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.05)
"""


def test_standalone_listens_on_loopback_alone(tmp_path: Path):
    """--standalone, 2 ranks: the rendezvous store, the agents' store (MASTER_PORT) and the job's store all on
    127.0.0.1 (torchrun's own: the first two on every address, `*`, and MASTER_ADDR a host name)."""
    (tmp_path / "rank.py").write_text(RANK)
    r = subprocess.run([sys.executable, "-m", "dflash_ds.distributed.torchrun", "--standalone", "--nproc_per_node",
                        "2", str(tmp_path / "rank.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    listening = next(line.split()[1:] for line in r.stdout.splitlines() if line.startswith("LISTEN"))
    assert len(listening) == 3 and all(a.startswith("127.0.0.1:") for a in listening), listening
    assert "rendezvous store on 127.0.0.1:" in r.stdout
