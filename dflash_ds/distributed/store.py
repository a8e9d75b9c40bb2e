"""The job's shared TCPStore, hosted by global rank 0 (see `topology` for the ports).

Under torchrun rank 0 binds it on a free port and publishes the port in the agent's store:
with `--standalone` or a c10d rendezvous torchrun picks MASTER_PORT itself, so MASTER_PORT + 1
may belong to any other socket. Without an agent store (the deepspeed launcher) it is
MASTER_PORT + 1, which must be free.

Where it listens: on MASTER_ADDR's own address alone, so no other interface reaches it. The launch scripts
always give an address (the deepspeed launcher the first of `hostname -I`; torchrun through
`dflash_ds.distributed.torchrun` the rank-0 node's --local-addr); a host name is bound to the address of this
host it resolves to, and one that resolves to no address of this host is an error naming it. Only a name that
resolves to loopback here and elsewhere to another address (a stock Debian/Ubuntu host's own name, given to a
plain torchrun) is served on every address, as PyTorch does: no one address serves both this host's ranks
and the others'.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time

import torch.distributed as dist

from dflash_ds.errors import DFlashError

STORE_PORT_OFFSET = 1  # MASTER_PORT + 1 when there is no agent store


def listen_address(master_addr: str) -> str | None:
    """The address the job's store binds to: MASTER_ADDR's own address on this host, None (all) for a name that
    resolves to loopback here (see the module docstring)."""
    from dflash_ds.distributed.netif import interface_of, resolve_all

    addrs = resolve_all(master_addr)
    looped = [a for a in addrs if ipaddress.ip_address(a).is_loopback]
    own = [a for a in addrs if a not in looped and interface_of(a) is not None]
    if own:
        return own[0]
    if looped:  # loopback given as such stays loopback; a name for it here may be another address elsewhere
        return looped[0] if master_addr in (*looped, "localhost") else None
    raise DFlashError(f"MASTER_ADDR {master_addr} resolves to {', '.join(addrs) or 'nothing'} on "
                      f"{socket.gethostname()}, the job's store's host (global rank 0), which owns no such address: "
                      "give this host's own address")


def _host_store(master_addr: str, port: int, world_size: int, timeout: datetime.timedelta,
                wait_for_workers: bool) -> dist.TCPStore:
    """The store's server (rank 0), bound to `listen_address(master_addr)` where there is one."""
    from dflash_ds.distributed.netif import listen_socket

    addr = listen_address(master_addr)
    if addr is None:
        return dist.TCPStore(master_addr, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    try:
        fd, port = listen_socket(addr, port, max(128, 2 * world_size))
    except OSError as exc:
        raise DFlashError(f"the job's store cannot listen on {addr}:{port} ({exc.strerror}): "
                          f"MASTER_PORT + {STORE_PORT_OFFSET} must be free") from None
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=fd)


def job_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: datetime.timedelta,
              agent_store: bool) -> dist.TCPStore:
    """The job's TCPStore, hosted by global rank 0: on a free port published through torchrun's agent store,
    else (no agent store: the deepspeed launcher) on master_port + 1."""
    if not agent_store:
        if rank == 0:
            return _host_store(master_addr, master_port + STORE_PORT_OFFSET, world_size, timeout, True)
        return dist.TCPStore(master_addr, master_port + STORE_PORT_OFFSET, world_size, is_master=False,
                             timeout=timeout, wait_for_workers=True)
    launcher = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
    # One key per run and attempt: the agent's store outlives a restarted attempt (--max-restarts).
    key = (f"dflash/job_store_port/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if rank == 0:
        store = _host_store(master_addr, 0, world_size, timeout, wait_for_workers=False)
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
