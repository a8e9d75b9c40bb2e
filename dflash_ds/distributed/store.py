"""The job's shared TCPStore, hosted by global rank 0 (see `topology` for the ports).

Under torchrun rank 0 binds it on a free port and publishes the port in the agent's store:
with `--standalone` or a c10d rendezvous torchrun picks MASTER_PORT itself, so MASTER_PORT + 1
may belong to any other socket. Without an agent store (the deepspeed launcher) it is
MASTER_PORT + 1, which must be free.

Where it listens: on MASTER_ADDR alone when that is an address of this host (the deepspeed launcher
gives the first address of `hostname -I`; torchrun an address given as RDZV_HOST / --local-addr), so
no other interface reaches it; given a host name (torchrun's c10d rendezvous), on every address, as
PyTorch does: the name may resolve to loopback here and to another address on the other hosts.
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
    """The address the job's store binds to: MASTER_ADDR when it is an address of this host, else None (all)."""
    from dflash_ds.distributed.netif import interface_of

    try:
        addr = ipaddress.ip_address(master_addr)
    except ValueError:
        return None  # a host name: see the module docstring
    if addr.is_loopback or interface_of(str(addr)) is not None:
        return str(addr)
    return None


def _host_store(master_addr: str, port: int, world_size: int, timeout: datetime.timedelta,
                wait_for_workers: bool) -> dist.TCPStore:
    """The store's server (rank 0), bound to `listen_address(master_addr)` where there is one."""
    addr = listen_address(master_addr)
    if addr is None:
        return dist.TCPStore(master_addr, port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as PyTorch's own listener
        sock.bind((addr, port))
        sock.listen(max(128, 2 * world_size))
    except OSError as exc:
        sock.close()
        raise DFlashError(f"the job's store cannot listen on {addr}:{port} ({exc.strerror}): "
                          f"MASTER_PORT + {STORE_PORT_OFFSET} must be free") from None
    # The store owns the descriptor from here on: detached, Python never closes it under the server.
    return dist.TCPStore(master_addr, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


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
