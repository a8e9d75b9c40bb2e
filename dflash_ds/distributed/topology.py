"""Which rank is a target and which a drafter, and the process groups each one gets.

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
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from dflash_ds.distributed.bridge import BridgeGroup
from dflash_ds.distributed.store import job_store
from dflash_ds.errors import DFlashError

Role = Literal["target", "drafter"]
TARGET: Role = "target"
DRAFTER: Role = "drafter"

ROLE_PORT_OFFSET: dict[str, int] = {TARGET: 2, DRAFTER: 3}

# Backend of each role's default group, by the job's backend. NCCL carries CUDA tensors only
# (an all_reduce of a CPU tensor raises "No backend type associated with device type cpu"), and
# the trainer reduces small host tensors every step (stop/skip flags, metric sums), as does
# DeepSpeed's bookkeeping: on GPU the role groups carry both, host tensors over gloo.
ROLE_BACKENDS = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}
# The bridge moves only hidden states, always on the rank's device: NCCL alone on GPU.
BRIDGE_BACKENDS = {"gloo": "gloo", "nccl": "nccl"}


def role_backend(cuda: bool) -> str:
    """Backend string of a default group that carries CPU tensors, and CUDA tensors over NCCL when `cuda`."""
    return ROLE_BACKENDS["nccl" if cuda else "gloo"]


def backend_devices(spec: str) -> set[str]:
    """Device types a backend string has a backend for: "nccl" -> {cuda}; "gloo" -> {cpu, cuda}; "cpu:gloo,cuda:nccl" -> both."""
    if ":" not in spec:
        return {"cuda"} if spec == "nccl" else {"cpu", "cuda"}
    return {part.split(":", 1)[0].strip() for part in spec.split(",") if part.strip()}


@dataclass
class Layout:
    """Which global ranks run the frozen target and which train the drafter."""

    world_size: int
    target_ranks: list[int]
    drafter_ranks: list[int]
    # Set for a per-node layout (every node runs this many ranks, some targets, some drafters):
    # batches are then routed within each node (see `route`).
    ranks_per_node: int | None = None
    # Colocated: no target ranks; every rank (a drafter here) also runs the frozen target on its own batches.
    colocated: bool = False
    _index: dict[int, tuple[Role, int]] = field(init=False, repr=False, compare=False)
    _local: dict[int, tuple[list[int], int, int]] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = sorted(self.target_ranks + self.drafter_ranks)
        if ranks != list(range(self.world_size)):
            raise DFlashError(
                f"layout does not cover ranks 0..{self.world_size - 1} exactly once: "
                f"targets {self.target_ranks}, drafters {self.drafter_ranks}"
            )
        if self.colocated and self.target_ranks:
            raise DFlashError(f"a colocated layout has no target ranks of its own, got {self.target_ranks}")
        if not self.drafter_ranks or not (self.target_ranks or self.colocated):
            raise DFlashError(
                f"layout has {len(self.target_ranks)} target and {len(self.drafter_ranks)} "
                "drafter ranks: need at least one target and one drafter"
            )
        self.target_ranks = sorted(self.target_ranks)
        self.drafter_ranks = sorted(self.drafter_ranks)
        self._index = {r: (TARGET, i) for i, r in enumerate(self.target_ranks)}
        self._index.update({r: (DRAFTER, i) for i, r in enumerate(self.drafter_ranks)})
        self._local = self._node_routes() if self.ranks_per_node else None

    def _node_routes(self) -> dict[int, tuple[list[int], int, int]] | None:
        """Per drafter: (target indices on its node, its position among the node's drafters, their number)."""
        g = self.ranks_per_node
        assert g
        targets_on: dict[int, list[int]] = {}
        drafters_on: dict[int, list[int]] = {}
        for i, r in enumerate(self.target_ranks):
            targets_on.setdefault(r // g, []).append(i)
        for d, r in enumerate(self.drafter_ranks):
            drafters_on.setdefault(r // g, []).append(d)
        if any(node not in targets_on for node in drafters_on):
            return None  # a node without targets: route over all targets
        return {d: (targets_on[node], pos, len(ds)) for node, ds in drafters_on.items() for pos, d in enumerate(ds)}

    @property
    def node_local(self) -> bool:
        """Whether every drafter is fed only by the targets of its own node."""
        return self._local is not None

    def route(self, step: int, drafter_idx: int) -> int:
        """Index of the target that computes drafter `drafter_idx`'s batch of micro-step `step`.

        Global layout: global batch g = step * D + d goes to target g mod T (`distributed/router.py`).
        Per-node layout: to a target on the drafter's own node, round robin over that node's targets
        in the order of the node's batches (step * D_node + position of d on the node), so hidden
        states never cross nodes and the node's targets share its drafters' batches evenly. Either
        way every target computes its batches, and every drafter receives them, in increasing g:
        FIFO channels cannot deadlock.
        """
        if self._local is None:
            return (step * self.num_drafters + drafter_idx) % self.num_targets
        targets, pos, n_local = self._local[drafter_idx]
        return targets[(step * n_local + pos) % len(targets)]

    @property
    def num_targets(self) -> int:
        """Number of target ranks (T)."""
        return len(self.target_ranks)

    @property
    def num_drafters(self) -> int:
        """Number of drafter ranks (D)."""
        return len(self.drafter_ranks)

    def role_name(self, rank: int) -> str:
        """What a rank does, for messages: target, drafter or colocated."""
        return "colocated" if self.colocated else self.role_of(rank)

    def role_of(self, rank: int) -> Role:
        """The role of a global rank."""
        return self._lookup(rank)[0]

    def local_rank_in_role(self, rank: int) -> int:
        """Index of a global rank among the ranks of its role (its rank in the role's group)."""
        return self._lookup(rank)[1]

    def ranks_of(self, role: Role) -> list[int]:
        """Global ranks of one role, in role-rank order."""
        return self.target_ranks if role == TARGET else self.drafter_ranks

    def describe(self) -> str:
        """One line for the console: which ranks do what."""
        if self.colocated:
            return (f"{self.world_size} colocated rank(s): each runs the target forward and trains the drafter "
                    f"(ranks {self.drafter_ranks})")
        return (f"{self.world_size} ranks: targets {self.target_ranks}, "
                f"drafters {self.drafter_ranks}" + ("; routed within each node" if self.node_local else ""))

    def _lookup(self, rank: int) -> tuple[Role, int]:
        if rank not in self._index:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return self._index[rank]


def make_layout(
    world_size: int,
    num_target_ranks: int | None,
    nproc_per_node: int | None = None,
    targets_per_node: int | None = None,
) -> Layout:
    """Global layout (first T ranks are targets) or per-node layout (first k local ranks of every node)."""
    if world_size < 2:
        raise DFlashError(
            f"a world of {world_size} rank(s) cannot hold a target and a drafter: launch at least 2 ranks"
        )
    if targets_per_node is None:
        if num_target_ranks is None:
            raise DFlashError("give --num-target-ranks or --targets-per-node to say which ranks run the target")
        t = num_target_ranks
        if t < 1 or t >= world_size:
            raise DFlashError(
                f"--num-target-ranks {t} leaves {max(world_size - t, 0)} drafter ranks in a world of "
                f"{world_size}: need at least one target and one drafter"
            )
        targets = list(range(t))
    else:
        if nproc_per_node is None or nproc_per_node < 1:
            raise DFlashError(
                f"--targets-per-node {targets_per_node} needs the number of ranks per node "
                f"(--nproc-per-node / LOCAL_WORLD_SIZE), got {nproc_per_node}"
            )
        if world_size % nproc_per_node:
            raise DFlashError(
                f"world size {world_size} is not a multiple of {nproc_per_node} ranks per node: "
                "a per-node layout needs every node to run the same number of ranks"
            )
        k = targets_per_node
        if k < 1 or k >= nproc_per_node:
            raise DFlashError(
                f"--targets-per-node {k} leaves {max(nproc_per_node - k, 0)} drafter ranks on a node of "
                f"{nproc_per_node}: need at least one target and one drafter per node"
            )
        nodes = world_size // nproc_per_node
        if num_target_ranks is not None and num_target_ranks != k * nodes:
            raise DFlashError(
                f"--num-target-ranks {num_target_ranks} disagrees with --targets-per-node {k} x "
                f"{nodes} nodes = {k * nodes}: give only one of them"
            )
        targets = [n * nproc_per_node + i for n in range(nodes) for i in range(k)]
    is_target = set(targets)
    drafters = [r for r in range(world_size) if r not in is_target]
    return Layout(world_size, targets, drafters, ranks_per_node=nproc_per_node if targets_per_node else None)


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
) -> RoleContext:
    """Give this rank a role-local default process group plus the all-rank bridge group.

    After this, `torch.distributed` (and so DeepSpeed) sees only the ranks of this
    role: RANK/WORLD_SIZE/MASTER_* in the environment are the role-local ones.
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
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    timeout = datetime.timedelta(seconds=timeout_s)

    # torchrun tells env:// to use its agent's store; our role-local world is not
    # the agent's, so a later env:// init would wait for it forever (docs/DESIGN.md §5).
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) == "True"
    store = job_store(master_addr, master_port, rank, layout.world_size, timeout, agent_store)

    # Ranks of my role on my host, for DeepSpeed's LOCAL_SIZE: its CPU shm
    # all-reduce assumes "all ranks local" when LOCAL_SIZE equals the world size.
    store.set(f"dflash/host/{rank}", socket.gethostname())
    me = store.get(f"dflash/host/{rank}")
    local_size = sum(store.get(f"dflash/host/{r}") == me for r in role_ranks)

    os.environ.update({
        "RANK": str(role_rank),
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
    dist.init_process_group(ROLE_BACKENDS[backend], store=dist.PrefixStore(f"dflash/{role}", store),
                            rank=role_rank, world_size=len(role_ranks), timeout=timeout)
    # A colocated job has nothing to carry between ranks but the ZeRO group's collectives.
    bridge = None if layout.colocated else _make_bridge(BRIDGE_BACKENDS[backend], dist.PrefixStore("dflash/bridge", store),
                                                         rank, layout.world_size, timeout)
    from dflash_ds.distributed import audit

    if audit.enabled():  # tests: check every tensor handed to torch.distributed (distributed/audit.py)
        bridge = audit.install(bridge, device)
    return RoleContext(layout, rank, role, role_rank, len(role_ranks), bridge, store, device, backend,
                       timeout_s)


def _make_bridge(backend: str, store: dist.Store, rank: int, world: int,
                 timeout: datetime.timedelta) -> BridgeGroup:
    """A point-to-point group over all ranks, never registered with torch.distributed."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    # Same options torch's own new_group() sets for NCCL (never run on a GPU yet: no GPU in CI).
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.global_ranks_in_group = list(range(world))
    opts.group_name = "dflash_bridge"
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def shutdown(ctx: RoleContext, timeout_s: float | None = None) -> None:
    """Tear down both groups; global rank 0 (the store host) leaves last so nobody loses the store."""
    # Peers may still use the store (new DeepSpeed subgroups, NCCL lazy init)
    # after this rank is done, so its host waits until every rank has checked out.
    ctx.store.add("dflash/shutdown", 1)
    if ctx.global_rank == 0:
        deadline = time.monotonic() + (ctx.timeout_s if timeout_s is None else timeout_s)
        while ctx.store.add("dflash/shutdown", 0) < ctx.layout.world_size:
            if time.monotonic() > deadline:
                break  # leave anyway; the ones still running will fail with a clear store error
            time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    if hasattr(ctx.bridge, "shutdown"):
        ctx.bridge.shutdown()
