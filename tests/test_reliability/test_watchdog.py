"""The watchdog's stop reason never blocks on the store (a blocked get once hung a SIGTERM'd leader)."""

import datetime
import signal
import socket
import threading
import time

import torch.distributed as dist

from dflash_ds.runtime.watchdog import STOP_KEY, Watchdog


def _store() -> dist.TCPStore:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))


def test_stop_reason_before_and_after_the_reason_is_published():
    store = _store()
    wd = Watchdog(store, 0, 1, lambda r: f"rank {r}", heartbeat_timeout_s=60, interval_s=0.05)
    assert wd.stop_reason() == "stop requested"
    wd._on_signal(signal.SIGTERM, None)  # what the handler does: flags only, nothing in the store yet
    assert wd.stop_event.is_set() and not store.check([STOP_KEY])
    t0 = time.monotonic()
    assert wd.stop_reason() == "SIGTERM on rank 0"  # returns at once instead of waiting for the key
    assert time.monotonic() - t0 < 1.0
    store.set(STOP_KEY, "SIGINT on rank 3")
    assert wd.stop_reason() == "SIGINT on rank 3"  # the job-wide reason wins once published


def test_thread_publishes_the_local_signal():
    store = _store()
    wd = Watchdog(store, 0, 1, lambda r: f"rank {r}", heartbeat_timeout_s=60, interval_s=0.05)
    thread = threading.Thread(target=wd._run, daemon=True)  # the watchdog's loop, without its signal handlers
    thread.start()
    wd._on_signal(signal.SIGINT, None)
    deadline = time.monotonic() + 5
    while not store.check([STOP_KEY]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.get(STOP_KEY).decode() == "SIGINT on rank 0"
    wd._closed.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


# outer -> middle (named like the deepspeed launcher) -> rank; the rank reports what it watches
_RANK = """
import sys, time
from dflash_ds.runtime.watchdog import LauncherWatch
w = LauncherWatch()
print(len(w.links), flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline and w.gone() is None:
    time.sleep(0.05)
print(w.gone(), flush=True)
"""
_MIDDLE = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1]]); time.sleep(30)"
_OUTER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], "
          "'deepspeed.launcher.launch']); print('up', flush=True); time.sleep(30)")


def test_launcher_watch_sees_the_deepspeed_launchers_parent_die(tmp_path):
    """Under the deepspeed launcher the rank watches two links; killing the runner above it breaks the second."""
    import os
    import sys

    from proc_utils import children, process_group

    out = open(tmp_path / "rank.txt", "w")
    with process_group([sys.executable, "-c", _OUTER, _MIDDLE, _RANK], stdout=out, text=True) as outer:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (tmp_path / "rank.txt").read_text().count("\n") >= 2:
            time.sleep(0.05)  # "up" and the rank's link count
        middle = children(outer.pid)
        os.kill(outer.pid, signal.SIGKILL)
        outer.wait()
        while time.monotonic() < deadline and (tmp_path / "rank.txt").read_text().count("\n") < 3:
            time.sleep(0.05)
        for pid in middle:
            os.kill(pid, signal.SIGKILL)  # the rank is in the same session: the group kill takes it
    lines = (tmp_path / "rank.txt").read_text().splitlines()
    assert lines[1] == "2", lines  # its parent, and the launcher's parent
    assert lines[2].startswith("the deepspeed launcher's parent (pid") and lines[2].endswith("is gone"), lines
