"""The start-up bound of a rank: a host that failed to start ends the job on the others too."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from dflash_ds.runtime import faults

# A rank whose start-up failed with an error sets FAILED_KEY/<rank> (one line: its host and error) and counts
# it in FAILED_KEY, so the others' bound needs one store call a poll, not one a rank.
FAILED_KEY = "dflash/startup_failed"
POLL_S = 0.5


class StartupBound:
    """Ends this rank when its start-up (process groups, bridge warm-up) outlasts train.startup_timeout_s,
    or, once the job's store exists, at once when another rank publishes there that its start-up failed.

    A rank that never gets its peers (a host that failed to start, a link that is down) would otherwise wait
    in `init_process_group` or the store for gloo's own timeouts (7+ minutes, measured on the hosts of
    tests/hosts.py) after the ranks of the failed host have exited; the launcher on this host only ends when
    its ranks do. The rank is blocked inside C++ there, so the bound is a thread that leaves with `os._exit`.
    A failure before the store exists reaches the others only at the bound.
    """

    EXIT_CODE = 1

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s, self.phase = rank, timeout_s, "joining the job's process groups"
        self._store, self._world = None, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dflash-startup-bound", daemon=True)
        self._thread.start()

    def watch_store(self, store, world_size: int) -> None:
        """Also watch the job's store for a rank that failed to start (called as soon as the store exists)."""
        from dflash_ds.runtime.watchdog import own_client

        # Its own client: the main thread blocks on the shared one (store waits, init_process_group).
        self._world, self._store = world_size, own_client(store)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
            failed = self._failed_peer()
            if failed is not None:
                self._exit(f"rank {failed[0]} failed to start ({self.phase}): {failed[1]}; exiting")
            if time.monotonic() >= deadline:
                self._exit(f"start-up not finished within train.startup_timeout_s={self.timeout_s:g}s "
                           f"({self.phase}): a rank or host that failed to start or cannot be reached "
                           "(see its log); exiting")

    def _failed_peer(self) -> tuple[int, str] | None:
        store = self._store
        if store is None:
            return None
        try:
            if store.add(FAILED_KEY, 0) == 0:
                return None
            for r in range(self._world):
                key = f"{FAILED_KEY}/{r}"
                if r != self.rank and store.check([key]):
                    return r, store.get(key).decode()
        except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone: the bound still ends this rank
            self._store = None
        return None

    def _exit(self, what: str) -> None:
        print(f"[dflash-ds] rank {self.rank}: {what}", file=sys.stderr, flush=True)
        try:
            faults.record_exit(self.EXIT_CODE, teardown=False)
        finally:  # nothing may keep this rank from leaving (an exception here would only end this thread)
            os._exit(self.EXIT_CODE)

    def done(self) -> None:
        """Start-up finished (or failed with its own error): the bound no longer applies."""
        self._done.set()
        self._thread.join(timeout=5)

    def fail(self, exc: BaseException) -> None:
        """Start-up failed here with `exc`: tell the other ranks through the store (when there is one), then stop."""
        if self._done.is_set():
            return  # start-up had finished: a later error is not a start-up failure
        self.done()
        if self._store is None:
            return
        first = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{first or type(exc).__name__} (on {socket.gethostname()})"
        try:
            self._store.set(f"{FAILED_KEY}/{self.rank}", reason)
            self._store.add(FAILED_KEY, 1)
        except Exception:  # noqa: BLE001 - the store is gone: the others' bound still ends them
            pass
