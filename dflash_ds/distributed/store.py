"""The job's shared TCPStore, hosted by global rank 0 (see `topology` for the ports).

Under torchrun rank 0 binds it on a free port and publishes the port in the agent's store:
with `--standalone` or a c10d rendezvous torchrun picks MASTER_PORT itself, so MASTER_PORT + 1
may belong to any other socket. Without an agent store (the deepspeed launcher) it is
MASTER_PORT + 1, which must be free.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from dflash_ds.errors import DFlashError

STORE_PORT_OFFSET = 1  # MASTER_PORT + 1 when there is no agent store


def job_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: datetime.timedelta,
              agent_store: bool) -> dist.TCPStore:
    """The job's TCPStore, hosted by global rank 0: on a free port published through torchrun's agent store,
    else (no agent store: the deepspeed launcher) on master_port + 1."""
    if not agent_store:
        return dist.TCPStore(master_addr, master_port + STORE_PORT_OFFSET, world_size, is_master=(rank == 0),
                             timeout=timeout, wait_for_workers=True)
    launcher = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
    # One key per run and attempt: the agent's store outlives a restarted attempt (--max-restarts).
    key = (f"dflash/job_store_port/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if rank == 0:
        store = dist.TCPStore(master_addr, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        launcher.set(key, str(store.port))
    else:
        launcher.wait([key], timeout)
        store = dist.TCPStore(master_addr, int(launcher.get(key)), world_size, is_master=False, timeout=timeout)
    # Every rank connected before anyone goes on (what wait_for_workers does on a fixed port).
    store.add("dflash/joined", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("dflash/joined", 0) < world_size:
        if time.monotonic() > deadline:
            raise DFlashError(f"only {store.add('dflash/joined', 0)} of {world_size} ranks reached the job's store "
                              f"within {timeout.total_seconds():.0f}s")
        time.sleep(0.02)
    return store
