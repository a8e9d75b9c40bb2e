"""What the launcher (torchrun, the deepspeed launcher) told this process, read from its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_ds.errors import DFlashError


@dataclass
class LaunchEnv:
    """What the launcher (torchrun, the deepspeed launcher) told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int


def read_launch_env() -> LaunchEnv:
    """Read RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as set by torchrun or the deepspeed launcher."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DFlashError(
            f"{', '.join(missing)} not set: start the job with torchrun or the deepspeed launcher"
        )
    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    lws = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE"))
    return LaunchEnv(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(lws) if lws else None,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
    )


class StartupBound:
    """Ends this rank when its start-up (process groups, bridge warm-up) outlasts train.startup_timeout_s.

    A rank that never gets its peers (a host that failed to start, a link that is down) would otherwise wait
    in `init_process_group` or the store for gloo's own timeouts (7+ minutes, measured on the hosts of
    tests/hosts.py) after the ranks of the failed host have exited; the launcher on this host only ends when
    its ranks do. The rank is blocked inside C++ there, so the bound is a thread that leaves with `os._exit`.
    """

    EXIT_CODE = 1

    def __init__(self, rank: int, timeout_s: float):
        import threading

        self.rank, self.timeout_s, self.phase = rank, timeout_s, "joining the job's process groups"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dflash-startup-bound", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import sys

        if self._done.wait(self.timeout_s):
            return
        from dflash_ds.runtime import faults

        print(f"[dflash-ds] rank {self.rank}: start-up not finished within train.startup_timeout_s="
              f"{self.timeout_s:g}s ({self.phase}): a rank or host that failed to start or cannot be reached "
              "(see its log); exiting", file=sys.stderr, flush=True)
        faults.record_exit(self.EXIT_CODE, teardown=False)
        os._exit(self.EXIT_CODE)

    def done(self) -> None:
        """Start-up finished (or failed with its own error): the bound no longer applies."""
        self._done.set()
        self._thread.join(timeout=5)
