"""The start-up bound of a rank: a host that failed to start ends the job on the others too."""

from __future__ import annotations

import os
import sys
import threading

from dflash_ds.runtime import faults


class StartupBound:
    """Ends this rank when its start-up (process groups, bridge warm-up) outlasts train.startup_timeout_s.

    A rank that never gets its peers (a host that failed to start, a link that is down) would otherwise wait
    in `init_process_group` or the store for gloo's own timeouts (7+ minutes, measured on the hosts of
    tests/hosts.py) after the ranks of the failed host have exited; the launcher on this host only ends when
    its ranks do. The rank is blocked inside C++ there, so the bound is a thread that leaves with `os._exit`.
    """

    EXIT_CODE = 1

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s, self.phase = rank, timeout_s, "joining the job's process groups"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dflash-startup-bound", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        print(f"[dflash-ds] rank {self.rank}: start-up not finished within train.startup_timeout_s="
              f"{self.timeout_s:g}s ({self.phase}): a rank or host that failed to start or cannot be reached "
              "(see its log); exiting", file=sys.stderr, flush=True)
        faults.record_exit(self.EXIT_CODE, teardown=False)
        os._exit(self.EXIT_CODE)

    def done(self) -> None:
        """Start-up finished (or failed with its own error): the bound no longer applies."""
        self._done.set()
        self._thread.join(timeout=5)
