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
    store.set(STOP_KEY, "SIGINT on rank 3")  # no acknowledgement: the watchdog's client sees it moments later
    deadline = time.monotonic() + 5
    while wd.stop_reason() != "SIGINT on rank 3" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wd.stop_reason() == "SIGINT on rank 3"  # the job-wide reason wins once published


def test_a_stop_another_rank_published_is_seen_without_waiting_for_a_beat():
    """The drafters ask `stop_requested` once a micro-batch: it must see the key at once, not a beat later (a short
    run's drafters once finished every step inside the second a target's SIGTERM waited for their next beat)."""
    store = _store()
    wd = Watchdog(store, 1, 2, lambda r: f"rank {r}", heartbeat_timeout_s=60, interval_s=3600)  # no beat comes
    assert not wd.stop_requested() and not wd.stop_event.is_set()
    store.set(STOP_KEY, "SIGTERM on rank 2")  # no acknowledgement: another client sees it moments later
    deadline = time.monotonic() + 5
    while not wd.stop_requested() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wd.stop_requested() and wd.stop_event.is_set()
    assert wd.stop_reason() == "SIGTERM on rank 2"


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


def _beating(store, rank: int, world: int, timeout_s: float, deaths: list) -> Watchdog:
    """A running watchdog whose `_die` records instead of ending the test process."""
    wd = Watchdog(store, rank, world, lambda r: f"rank {r}", heartbeat_timeout_s=timeout_s, interval_s=0.1)
    wd._die = lambda peer, message: deaths.append((rank, peer, message))  # type: ignore[method-assign]
    wd._beat()
    threading.Thread(target=wd._run, daemon=True).start()
    return wd


def test_heartbeats_go_on_while_the_shared_client_blocks():
    """Rank 0's main thread blocks on the shared store client longer than the heartbeat timeout (as a non-leader
    drafter does through the leader's resharding): rank 1 must not call it lost."""
    host = _store()
    shared = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    deaths: list = []
    timeout_s = 1.5
    w0 = _beating(shared, 0, 2, timeout_s, deaths)
    w1 = _beating(dist.TCPStore("127.0.0.1", host.port, is_master=False), 1, 2, timeout_s, deaths)
    t0 = time.monotonic()
    try:
        shared.wait(["dflash/never"], datetime.timedelta(seconds=3 * timeout_s))
    except Exception:  # noqa: BLE001 - the wait times out, as meant
        pass
    assert time.monotonic() - t0 >= 3 * timeout_s - 0.1  # the client really was held that long
    time.sleep(0.5)
    for wd in (w0, w1):
        wd._closed.set()
    assert w0.store is not shared  # a client of its own
    assert deaths == [], deaths


def test_the_hazard_the_own_client_removes():
    """Control: a watchdog forced onto the blocked client stalls, and its peer calls it lost (what happened before
    the watchdog had its own client), so the test above can fail."""
    import dflash_ds.runtime.watchdog as watchdog_mod

    host = _store()
    shared = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    deaths: list = []
    own = watchdog_mod.own_client
    watchdog_mod.own_client = lambda store: store
    try:
        w0 = _beating(shared, 0, 2, 1.5, deaths)
    finally:
        watchdog_mod.own_client = own
    w1 = _beating(dist.TCPStore("127.0.0.1", host.port, is_master=False), 1, 2, 1.5, deaths)
    try:
        shared.wait(["dflash/never"], datetime.timedelta(seconds=9))  # 6 beats: margin for a loaded machine
    except Exception:  # noqa: BLE001
        pass
    for wd in (w0, w1):
        wd._closed.set()
    assert any(rank == 1 and peer == 0 for rank, peer, _ in deaths), deaths


_TARGET_HOOK = """
import fcntl, os, sys, types
import torch.distributed as dist
from dflash_ds.runtime.target_worker import _exit_once_drafters_stopped
from dflash_ds.runtime.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False)
wd = Watchdog(store, 2, 3, str, heartbeat_timeout_s=60)
wd.stop_event.set()  # the job-wide stop this rank saw
flags = fcntl.fcntl(1, fcntl.F_GETFL)  # stdout: a pipe its reader has stopped reading, full
fcntl.fcntl(1, fcntl.F_SETFL, flags | os.O_NONBLOCK)
try:
    while True:
        os.write(1, b"x" * 4096)
except BlockingIOError:
    pass
fcntl.fcntl(1, fcntl.F_SETFL, flags)
os.write(2, b"full\\n")
ctx = types.SimpleNamespace(global_rank=2, layout=types.SimpleNamespace(drafter_ranks=[0, 1]))
_exit_once_drafters_stopped(ctx, wd)  # the watchdog thread's tick: both drafters are done
os.write(2, b"returned\\n")
"""


def test_a_target_with_a_stalled_stdout_checks_out_and_ends_75_once_its_drafters_stopped(tmp_path):
    """A target's watchdog leaves with 75 once every drafter checkpointed and finished. Its stdout (a pipe to
    torchrun / slurmstepd) may be full: the thread said so first and blocked there, without a beat, until rank 0
    called it lost and left, and the store guard ended it with 3 a minute later: SLURM did not requeue a job whose
    checkpoint was complete (seen once on CI). Now the rank checks out, records 75 and ends 75 all the same."""
    import subprocess
    import sys

    from proc_utils import process_group

    from dflash_ds.runtime.watchdog import STOP_STEP_KEY

    store = _store()
    store.set(STOP_STEP_KEY, "8")
    store.set("dflash/done/0", "1"), store.set("dflash/done/1", "1")
    env = {**__import__("os").environ, "DFLASH_EXIT_STATUS_DIR": str(tmp_path), "RANK": "2"}
    with process_group([sys.executable, "-c", _TARGET_HOOK, str(store.port)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=env) as proc:  # stdout never read
        assert proc.stderr.readline() == b"full\n"
        status = proc.wait(timeout=30)
        assert status == 75, proc.stderr.read().decode()[-2000:]
    assert store.check(["dflash/done/2"]) and store.add("dflash/shutdown", 0) == 1  # rank 0 sees it checked out
    assert __import__("json").loads((tmp_path / "rank2.json").read_text())["status"] == 75
