"""After its role has ended, a rank that gets torchrun's SIGTERM exits with its own status at once, even with
its main thread blocked in C (a group's shutdown): ignored, torchrun's SIGKILL 30 s later made it -9."""

import signal
import sys

from proc_utils import process_group

_RANK = """
import threading
from dflash_ds.runtime.watchdog import ExitOnSignal
on_signal = ExitOnSignal(75, 0)
print("ready", flush=True)
lock = threading.Lock(); lock.acquire(); lock.acquire()  # stands for a teardown blocked in C
"""
_RANK_CLOSED = """
import os, signal, time
from dflash_ds.runtime.watchdog import ExitOnSignal
on_signal = ExitOnSignal(75, 0)
on_signal.close()
os.kill(os.getpid(), signal.SIGTERM)  # during the interpreter's teardown: ignored, the status stands
time.sleep(0.2)
raise SystemExit(3)
"""


def test_sigterm_after_the_role_exits_with_the_ranks_status_while_blocked():
    import subprocess

    with process_group([sys.executable, "-c", _RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) as proc:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 75
        assert "SIGTERM after its role ended: exiting with status 75" in proc.stderr.read()


def test_after_close_a_sigterm_is_ignored():
    from proc_utils import run_bounded

    assert run_bounded([sys.executable, "-c", _RANK_CLOSED], 60).returncode == 3
