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
