"""Which global ranks run the frozen target and which train the drafter (pure: no process groups).

One convention for every job: drafters take the first ranks and targets the last, so global
rank 0 is always the leading drafter (it logs, writes W&B and orchestrates checkpoints). A
global layout makes the last T ranks targets; a per-node layout the last k local ranks of
every node, each feeding the drafters of its own node (`Layout.route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ds.errors import DFlashError

Role = Literal["target", "drafter"]
TARGET: Role = "target"
DRAFTER: Role = "drafter"


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
    # Ranks per target replica (topology.target_parallel): consecutive target ranks hold one copy of the target
    # between them, on one node; the first of each replica (its leader) sends the batches. 1: every target rank.
    target_parallel: int = 1
    # Drafter ranks per sequence-parallel group (topology.sequence_parallel): N consecutive drafter ranks train one
    # batch together, each on 1/N of its positions; the D drafters are D / N data-parallel replicas.
    sequence_parallel: int = 1
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
        k = self.target_parallel
        if k < 1 or len(self.target_ranks) % k:
            raise DFlashError(f"topology.target_parallel {k} does not divide the {len(self.target_ranks)} target "
                              f"ranks {self.target_ranks}: every replica needs exactly {k} ranks")
        for replica in self.replicas:
            if replica != list(range(replica[0], replica[0] + k)):
                raise DFlashError(f"target replica {replica} (topology.target_parallel {k}) is not {k} consecutive "
                                  f"ranks")
        n = self.sequence_parallel
        if n < 1 or len(self.drafter_ranks) % n:
            raise DFlashError(f"topology.sequence_parallel {n} does not divide the {len(self.drafter_ranks)} drafter "
                              f"ranks: every group of consecutive drafter ranks needs exactly {n}")
        self._index = {r: (TARGET, i) for i, r in enumerate(self.target_ranks)}
        self._index.update({r: (DRAFTER, i) for i, r in enumerate(self.drafter_ranks)})
        self._local = self._node_routes() if self.ranks_per_node else None

    def _node_routes(self) -> dict[int, tuple[list[int], int, int]] | None:
        """Per data group (a drafter when N = 1): (target indices on its node, its position among the node's
        groups, their number). A sequence-parallel group belongs to the node of its first rank."""
        g = self.ranks_per_node
        assert g
        targets_on: dict[int, list[int]] = {}
        drafters_on: dict[int, list[int]] = {}
        for i, leader in enumerate(self.senders):
            targets_on.setdefault(leader // g, []).append(i)
        for d, members in enumerate(self.sequence_groups()):
            drafters_on.setdefault(self.drafter_ranks[members[0]] // g, []).append(d)
        if any(node not in targets_on for node in drafters_on):
            return None  # a node without targets: route over all targets
        return {d: (targets_on[node], pos, len(ds)) for node, ds in drafters_on.items() for pos, d in enumerate(ds)}

    @property
    def node_local(self) -> bool:
        """Whether every drafter is fed only by the targets of its own node."""
        return self._local is not None

    @property
    def replicas(self) -> list[list[int]]:
        """Global ranks of each target replica (topology.target_parallel consecutive target ranks), in order."""
        k = self.target_parallel
        return [self.target_ranks[i:i + k] for i in range(0, len(self.target_ranks), k)]

    @property
    def senders(self) -> list[int]:
        """The rank of each replica that sends its batches over the bridge (its first); all target ranks when k = 1."""
        return self.target_ranks[::self.target_parallel]

    def replica_of(self, rank: int) -> tuple[int, int]:
        """(replica index, position in the replica) of a target rank."""
        i = self.target_ranks.index(rank)
        return i // self.target_parallel, i % self.target_parallel

    def route(self, step: int, drafter_idx: int) -> int:
        """Index of the target (replica) that computes batch `drafter_idx` of micro-step `step`: the batch of drafter
        `drafter_idx`, or under sequence parallelism of data group `drafter_idx` (`data_rank`; D below is then the
        D / N groups, and the target sends each of the group's N ranks its shard: `drafter_ranks_for`).

        Global layout: global batch g = step * D + d goes to target g mod T, which keeps the T
        targets within one batch of each other over any prefix of the stream, for any T:D.
        Per-node layout: to a target on the drafter's own node, round robin over that node's
        targets in the order of the node's batches (step * D_node + position of d on the node), so
        hidden states never cross nodes and the node's targets share its drafters' batches evenly.
        Either way every target computes its batches, and every drafter receives them, in
        increasing g: FIFO channels cannot deadlock (the smallest unfinished g can always finish:
        its target has sent, and its drafter received, every earlier batch of theirs).
        tests/test_distributed/test_router.py simulates both.
        """
        if self._local is None:
            return (step * self.data_parallel + drafter_idx) % self.num_targets
        targets, pos, n_local = self._local[drafter_idx]
        return targets[(step * n_local + pos) % len(targets)]

    def target_rank_for(self, step: int, drafter_idx: int) -> int:
        """Global rank that sends batch `drafter_idx` of micro-step `step` (`route`; a replica's leader)."""
        return self.senders[self.route(step, drafter_idx)]

    def drafter_rank_for(self, batch_id: int) -> int:
        """Global rank of the drafter that trains global batch `batch_id` (batch u * D + d of micro-step u: drafter d);
        under sequence parallelism the first rank of its group (`drafter_ranks_for`)."""
        return self.drafter_ranks_for(batch_id)[0]

    def drafter_ranks_for(self, batch_id: int) -> list[int]:
        """Global ranks that train global batch `batch_id` together: its sequence-parallel group (batch u * D/N + g
        of micro-step u: group g), in shard order; one drafter when N = 1."""
        n = self.sequence_parallel
        g = batch_id % self.data_parallel
        return self.drafter_ranks[g * n:(g + 1) * n]

    @property
    def num_targets(self) -> int:
        """Number of targets (T): target replicas, each of topology.target_parallel ranks (1: target ranks)."""
        return len(self.target_ranks) // self.target_parallel

    @property
    def num_drafters(self) -> int:
        """Number of drafter ranks (D)."""
        return len(self.drafter_ranks)

    @property
    def data_parallel(self) -> int:
        """Data-parallel drafter replicas (D / N): the batches a micro-step trains, one per sequence-parallel group."""
        return self.num_drafters // self.sequence_parallel

    def data_rank(self, drafter_idx: int) -> int:
        """Which batch of a micro-step drafter `drafter_idx` trains (its sequence-parallel group's index)."""
        return drafter_idx // self.sequence_parallel

    def sequence_groups(self) -> list[list[int]]:
        """Drafter indices of each sequence-parallel group, in order (one group of one per drafter when N = 1)."""
        n = self.sequence_parallel
        return [list(range(i, i + n)) for i in range(0, self.num_drafters, n)]

    def groups_across_nodes(self, ranks_per_node: int | None) -> list[list[int]]:
        """Global ranks of each sequence-parallel group whose ranks lie on more than one node of `ranks_per_node`
        (its all-to-alls then cross the network every layer: allowed, slower); [] without SP or a node size."""
        if self.sequence_parallel == 1 or not ranks_per_node:
            return []
        groups = [[self.drafter_ranks[i] for i in g] for g in self.sequence_groups()]
        return [g for g in groups if len({r // ranks_per_node for r in g}) > 1]

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
        sp = (f"; sequence parallel over {self.sequence_parallel} ranks: {self.data_parallel} batch(es) a "
              f"micro-step" if self.sequence_parallel > 1 else "")
        if self.colocated:
            return (f"{self.world_size} colocated rank(s): each runs the target forward and trains the drafter "
                    f"(ranks {self.drafter_ranks}){sp}")
        targets = (f"targets {self.target_ranks}" if self.target_parallel == 1 else
                   f"{self.num_targets} target replica(s) of {self.target_parallel} ranks {self.replicas}")
        return (f"{self.world_size} ranks: {targets}, "
                f"drafters {self.drafter_ranks}" + ("; routed within each node" if self.node_local else "")
                + (sp and f"{sp}, each rank sent its shard"))

    def _lookup(self, rank: int) -> tuple[Role, int]:
        if rank not in self._index:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return self._index[rank]


def make_layout(
    world_size: int,
    num_target_ranks: int | None,
    nproc_per_node: int | None = None,
    targets_per_node: int | None = None,
    target_parallel: int = 1,
    sequence_parallel: int = 1,
) -> Layout:
    """Drafters first, targets last: the last T ranks (global layout) or the last k local ranks of every node."""
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
        targets = list(range(world_size - t, world_size))
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
        targets = [(n + 1) * nproc_per_node - k + i for n in range(nodes) for i in range(k)]
    is_target = set(targets)
    drafters = [r for r in range(world_size) if r not in is_target]
    layout = Layout(world_size, targets, drafters, ranks_per_node=nproc_per_node if targets_per_node else None,
                    target_parallel=target_parallel, sequence_parallel=sequence_parallel)
    if nproc_per_node:  # a replica's tensor-parallel collectives stay on one node
        for replica in layout.replicas:
            if replica[0] // nproc_per_node != replica[-1] // nproc_per_node:
                raise DFlashError(f"target replica {replica} (topology.target_parallel {target_parallel}) spans two "
                                  f"nodes of {nproc_per_node} ranks: choose the target ranks so that each node holds "
                                  f"whole replicas")
    return layout
