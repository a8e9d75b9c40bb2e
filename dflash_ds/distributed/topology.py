"""The process groups each rank gets: its role's default group and the all-rank bridge group.

Why the groups look like this (docs/DESIGN.md §5): when all ranks share one default
process group and only drafters build the DeepSpeed engine, DeepSpeed still
issues world-wide collectives (`save_checkpoint`'s tag all_reduce and final
barrier, ZeRO-3's init barrier) that target ranks never join, and the job
hangs. So every role gets its *own* default group (targets: inference group;
drafters: training group, which DeepSpeed then sees as its whole world) and
hidden states travel over one extra "bridge" group spanning all ranks, built
directly on a shared store and never registered as a default group.

Ports, all derived from the launcher's master port P:

- P     belongs to the launcher. Under torchrun it is the agent's store: used
        once, to publish the port of ours (below), never for groups.
- the shared TCPStore, hosted by global rank 0 on `master_addr`. Every group
        rendezvouses through it under its own prefix (`dflash/bridge`,
        `dflash/target`, `dflash/drafter`). One host for all three keeps
        multi-node layouts simple: the first drafter may live on any node, but
        global rank 0 is always on the node `master_addr` names. Under torchrun
        rank 0 binds it on a free port and publishes the port in the agent's
        store (`store.job_store`): with `--standalone` or a c10d rendezvous torchrun
        picks P itself, and P + 1 may be any other socket's port. Without an
        agent store (the deepspeed launcher) it is P + 1, which must be free.
- P + 2 exported as MASTER_PORT to target ranks, P + 3 to drafter ranks.
        Nothing listens there; code that re-reads the env (DeepSpeed names its
        shared-memory all-reduce segments after MASTER_ADDR/MASTER_PORT) then
        sees one distinct value per role instead of a collision.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_ds.distributed.backends import BRIDGE_BACKENDS, ROLE_BACKENDS, make_bridge
from dflash_ds.distributed.bridge import BridgeGroup
from dflash_ds.distributed.layout import DRAFTER, TARGET, Layout, Role
from dflash_ds.distributed.netif import choose_socket_ifname
from dflash_ds.distributed.store import job_store
from dflash_ds.errors import DFlashError

# The warm-up handshake's bridge tag, apart from the batches' channels and the start message's.
WARM_UP_TAG = 99
ROLE_PORT_OFFSET: dict[str, int] = {TARGET: 2, DRAFTER: 3}


@dataclass
class RoleContext:
    """Everything a rank needs to talk to its role group and across the bridge."""

    layout: Layout
    global_rank: int
    role: Role
    role_rank: int
    role_world: int
    bridge: BridgeGroup | None  # all ranks, global rank numbering (see bridge.py); None when colocated
    store: dist.Store  # the shared TCPStore hosted by global rank 0
    device: torch.device
    backend: str
    timeout_s: float
    # Target ranks of a sharded replica (topology.target_parallel k > 1): which replica, and this rank's place in
    # it. The replica is then this rank's default process group (k ranks): transformers' tensor parallelism
    # shards the target over it. With k = 1 all target ranks share one group, as before.
    replica: int | None = None
    replica_rank: int = 0
    abort_bridge: bool = False  # receives are still posted at exit: abort the bridge, do not shut it down
    bridge_timeout_s: float = 1800.0  # transfers between targets and drafters (train.bridge_timeout_s)
    # Drafter ranks under topology.sequence_parallel N > 1: the process group of this rank's N-rank group (the
    # Ulysses all-to-all runs in it); None otherwise.
    sp_group: dist.ProcessGroup | None = None

    @property
    def data_rank(self) -> int:
        """Which batch of a micro-step this drafter trains: its role rank, or its sequence-parallel group's index."""
        return self.layout.data_rank(self.role_rank)

    @property
    def is_target(self) -> bool:
        """True on target ranks."""
        return self.role == TARGET


def init_role_groups(
    layout: Layout,
    rank: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 1800.0,
    local_rank: int | None = None,
    bridge_timeout_s: float | None = None,
    on_store: Callable[[dist.Store], None] | None = None,
) -> RoleContext:
    """Give this rank a role-local default process group plus the all-rank bridge group.

    After this, `torch.distributed` (and so DeepSpeed) sees only the ranks of this
    role: RANK/WORLD_SIZE/MASTER_* in the environment are the role-local ones. The
    tests' device-placement audit (`audit.install`) is the launching code's to add.
    `on_store` is called with the job's store as soon as it exists.
    """
    if dist.is_initialized():
        # A world-wide default group is exactly the layout that hangs DeepSpeed.
        raise RuntimeError("init_role_groups must create the default process group; one already exists")
    if backend not in ("gloo", "nccl"):
        raise DFlashError(f"backend {backend!r} is not supported: use gloo (CPU) or nccl (GPU)")
    if backend == "nccl" and not dist.is_nccl_available():
        raise DFlashError("backend nccl needs a CUDA build of torch; use gloo on CPU")
    role = layout.role_of(rank)
    role_rank = layout.local_rank_in_role(rank)
    role_ranks = layout.ranks_of(role)
    group_prefix, replica, replica_rank = f"dflash/{role}", None, 0
    if role == TARGET and layout.target_parallel > 1:
        replica, replica_rank = layout.replica_of(rank)
        role_ranks, group_prefix = layout.replicas[replica], f"dflash/{role}/replica{replica}"
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    timeout = datetime.timedelta(seconds=timeout_s)

    # torchrun tells env:// to use its agent's store; our role-local world is not
    # the agent's, so a later env:// init would wait for it forever (docs/DESIGN.md §5).
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) == "True"
    store = job_store(master_addr, master_port, rank, layout.world_size, timeout, agent_store)
    if on_store is not None:  # the launcher watches it for ranks that failed to start (runtime/startup.py)
        on_store(store)
    # gloo/NCCL advertise the address the host name resolves to (loopback on stock Debian/Ubuntu): every rank
    # takes the interface that routes to the master unless the user named one (distributed/netif.py).
    choose_socket_ifname(store, rank, layout.world_size, master_addr, backend == "nccl", timeout_s)

    # Ranks of my role on my host, for DeepSpeed's LOCAL_SIZE: its CPU shm
    # all-reduce assumes "all ranks local" when LOCAL_SIZE equals the world size.
    store.set(f"dflash/host/{rank}", socket.gethostname())
    me = store.get(f"dflash/host/{rank}")
    local_size = sum(store.get(f"dflash/host/{r}") == me for r in role_ranks)

    group_rank = role_ranks.index(rank)
    os.environ.update({
        "RANK": str(group_rank),
        "WORLD_SIZE": str(len(role_ranks)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port + ROLE_PORT_OFFSET[role]),
        # LOCAL_RANK stays the device index on this node: DeepSpeed picks the GPU with it.
        "LOCAL_RANK": str(local_rank),
        "LOCAL_SIZE": str(local_size),
        "DFLASH_GLOBAL_RANK": str(rank),
        "DFLASH_GLOBAL_WORLD_SIZE": str(layout.world_size),
        "DFLASH_ROLE": role,
    })

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(ROLE_BACKENDS[backend], store=dist.PrefixStore(group_prefix, store),
                            rank=group_rank, world_size=len(role_ranks), timeout=timeout)
    sp_group = None
    if role == DRAFTER and layout.sequence_parallel > 1:  # every drafter makes every group, in one order
        for members in layout.sequence_groups():
            group = dist.new_group(ranks=members)
            sp_group = group if role_rank in members else sp_group
    # A colocated job has nothing to carry between ranks but the ZeRO group's collectives.
    bridge_timeout = datetime.timedelta(seconds=bridge_timeout_s or timeout_s)
    bridge = None if layout.colocated else make_bridge(BRIDGE_BACKENDS[backend], dist.PrefixStore("dflash/bridge", store),
                                                        rank, layout.world_size, bridge_timeout)
    return RoleContext(layout, rank, role, role_rank, len(layout.ranks_of(role)), bridge, store, device, backend,
                       timeout_s, replica=replica, replica_rank=replica_rank,
                       bridge_timeout_s=bridge_timeout_s or timeout_s, sp_group=sp_group)


def warm_up_bridge(ctx: RoleContext, timeout_s: float) -> float:
    """Connect every (target, drafter) pair of the bridge now, one tiny transfer each; returns the seconds taken.

    NCCL builds a pair's communicator at its first send/recv, under the bridge's timeout; left to the
    first batch, a target that waits for a resuming or resharding leader would build it minutes later
    and die. Done here, at start-up, under `timeout_s` (train.startup_timeout_s). Pairs go in one global
    order (by target, then drafter) and every rank takes its own in that order: the first unfinished
    pair always has both ends ready, so the handshakes cannot deadlock.
    """
    from dflash_ds.distributed.bridge import wait_all

    t0 = time.monotonic()
    lay = ctx.layout
    for t in lay.target_ranks:
        for d in lay.drafter_ranks:
            if ctx.global_rank not in (t, d):
                continue
            token = torch.zeros(1, dtype=torch.int64, device=ctx.device)
            peer = d if ctx.global_rank == t else t
            work = ctx.bridge.send([token], d, WARM_UP_TAG) if ctx.global_rank == t else \
                ctx.bridge.recv([token], t, WARM_UP_TAG)
            wait_all([work], peer, timeout_s, "connecting the bridge")
    return time.monotonic() - t0


def shutdown(ctx: RoleContext, timeout_s: float | None = None, lost: Callable[[], int] = lambda: 0) -> None:
    """Tear down both groups; global rank 0 (the store host) leaves last so nobody loses the store.

    `lost()`: how many ranks died without checking out (the watchdog's count); rank 0 does not wait for them.
    """
    # Peers may still use the store (new DeepSpeed subgroups, NCCL lazy init)
    # after this rank is done, so its host waits until every rank has checked out.
    ctx.store.add("dflash/shutdown", 1)
    if ctx.global_rank == 0:
        deadline = time.monotonic() + (ctx.timeout_s if timeout_s is None else timeout_s)
        while ctx.store.add("dflash/shutdown", 0) < ctx.layout.world_size - lost():
            if time.monotonic() > deadline:
                break  # leave anyway; the ones still running will fail with a clear store error
            time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    if ctx.abort_bridge and hasattr(ctx.bridge, "abort"):
        ctx.bridge.abort()  # receives posted past the stop step: nothing will ever match them
    elif hasattr(ctx.bridge, "shutdown"):
        ctx.bridge.shutdown()
