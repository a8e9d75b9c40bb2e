"""The harness kills a hung torchrun job's ranks, not only its launcher (torchrun puts each rank in a session
of its own, so the launcher's process group does not hold them)."""

import sys
import time

import pytest

from proc_utils import alive, run_bounded

# A rank that hangs; it lets go of the launcher's output pipes, so a surviving rank fails the assertion below
# rather than blocking run_bounded's read until pytest-timeout.
_RANK = ("import os, sys, time; n = os.open(os.devnull, os.O_WRONLY); os.dup2(n, 1); os.dup2(n, 2); "
         "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid())); time.sleep(120)")


def test_timed_out_torchrun_leaves_no_rank(tmp_path):
    """A real torchrun job of 2 ranks that hang: run_bounded times out, and no rank outlives it."""
    script = tmp_path / "hang.py"
    script.write_text(_RANK + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path)]
    # The ranks import nothing heavy: they start within the agent's own start-up (~3 s of torch import on 2 idle
    # cores, ~6 s loaded), well inside the bound.
    with pytest.raises(AssertionError, match="timed out after 12s"):
        run_bounded(cmd, 12)
    pids = {p.name: int(p.read_text()) for p in tmp_path.iterdir() if p.name in ("0", "1")}
    assert sorted(pids) == ["0", "1"], "the ranks did not start within the bound"
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not [r for r, p in pids.items() if alive(p)], f"ranks {pids} outlived their timed-out launcher"
