"""The test harness itself: a timed-out launcher takes its children with it."""

import os
import sys
import time

import pytest

from proc_utils import run_bounded


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time\n"
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
              f"time.sleep(300)\n")
    with pytest.raises(AssertionError, match="timed out after 3s"):
        run_bounded([sys.executable, "-c", script], 3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie awaiting its (dead) parent's reaper is gone too
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"grandchild {child} outlived the timed-out launcher")


def test_completed_process_output_and_status():
    r = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
