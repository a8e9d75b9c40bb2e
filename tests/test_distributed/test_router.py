"""Router plans: every batch once, lockstep drafters, balanced targets, and no deadlock on FIFO channels."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from router_sim import QueueDepthMeter, Route, plan_for_drafter, plan_for_target, route

RATIOS = [(t, d) for t in range(1, 5) for d in range(1, 5)]
STEPS = 13  # not a multiple of any T or D, so uneven tails are covered


@pytest.mark.parametrize("T, D", RATIOS)
def test_every_batch_is_computed_once_and_trained_once(T: int, D: int) -> None:
    total = STEPS * D
    target_plans = [list(plan_for_target(t, T, D, STEPS)) for t in range(T)]
    drafter_plans = [list(plan_for_drafter(d, T, D, STEPS)) for d in range(D)]
    computed = sorted(r.global_batch for plan in target_plans for r in plan)
    trained = sorted(r.global_batch for plan in drafter_plans for r in plan)
    assert computed == trained == list(range(total))
    for t, plan in enumerate(target_plans):
        gs = [r.global_batch for r in plan]
        assert gs == sorted(gs) and all(r.target_idx == t for r in plan)
    for d, plan in enumerate(drafter_plans):
        # One micro-batch per step, its own ones, in step order.
        assert [r.step for r in plan] == list(range(STEPS))
        assert [r.global_batch for r in plan] == [s * D + d for s in range(STEPS)]
        assert all(r.drafter_idx == d and r == route(r.global_batch, T, D) for r in plan)


@pytest.mark.parametrize("T, D", RATIOS)
def test_targets_stay_within_one_batch_of_each_other(T: int, D: int) -> None:
    owner = {r.global_batch: t for t in range(T) for r in plan_for_target(t, T, D, STEPS)}
    loads = [0] * T
    for g in range(STEPS * D):  # every prefix of the stream
        loads[owner[g]] += 1
        assert max(loads) - min(loads) <= 1


def test_equal_counts_pair_each_drafter_with_one_target() -> None:
    assert {(r.target_idx, r.drafter_idx) for r in plan_for_drafter(2, 4, 4, 10)} == {(2, 2)}


def test_resume_and_unbounded_plans() -> None:
    full = list(plan_for_target(1, 3, 2, num_steps=10))
    assert list(plan_for_target(1, 3, 2, num_steps=4, start_step=5)) == [r for r in full if 5 <= r.step < 9]
    assert list(itertools.islice(plan_for_target(1, 3, 2), len(full))) == full
    assert list(plan_for_drafter(1, 3, 2, num_steps=3, start_step=2)) == [
        Route(5, 2, 2, 1), Route(7, 3, 1, 1), Route(9, 4, 0, 1)]
    with pytest.raises(ValueError):
        list(plan_for_target(3, 3, 2, 1))


def simulate(T: int, D: int, steps: int, send_depth: int, recv_depth: int,
             target_plans: list[list[int]] | None = None, owner=None) -> str:
    """Run targets and lockstep drafters over rendezvous FIFO channels: "done", "deadlock" or "mismatch".

    A send completes only when its receiver has posted the matching receive
    (gloo semantics). A target keeps at most `send_depth` batches posted and
    waits on the oldest; a drafter keeps at most `recv_depth` receives posted,
    trains on its batches in order, and cannot start step s+1 before every
    drafter has finished step s (the ZeRO all-reduce).
    """
    if target_plans is None:
        target_plans = [[r.global_batch for r in plan_for_target(t, T, D, steps)] for t in range(T)]
    owner = owner or (lambda g: g % T)  # which target computes global batch g
    drafter_plans = [[r.global_batch for r in plan_for_drafter(d, T, D, steps)] for d in range(D)]
    sends: dict[tuple[int, int], deque[int]] = {}
    recvs: dict[tuple[int, int], deque[int]] = {}
    delivered: set[int] = set()
    next_send = [0] * T
    in_flight: list[deque[int]] = [deque() for _ in range(T)]
    posted, trained = [0] * D, [0] * D
    progress = True
    while progress:
        progress = False
        for t in range(T):
            while in_flight[t] and in_flight[t][0] in delivered:
                in_flight[t].popleft()
            if next_send[t] < len(target_plans[t]) and len(in_flight[t]) < send_depth:
                g = target_plans[t][next_send[t]]
                sends.setdefault((t, g % D), deque()).append(g)
                in_flight[t].append(g)
                next_send[t] += 1
                progress = True
        for d in range(D):
            in_barrier = trained[d] > min(trained)
            if not in_barrier and posted[d] < steps and posted[d] - trained[d] < recv_depth:
                g = drafter_plans[d][posted[d]]
                recvs.setdefault((owner(g), d), deque()).append(g)
                posted[d] += 1
                progress = True
        for key in set(sends) & set(recvs):
            while sends[key] and recvs[key]:
                g = sends[key].popleft()
                if g != recvs[key].popleft():
                    return "mismatch"  # the bridge would raise "expected batch x, got y"
                delivered.add(g)
                progress = True
        for d in range(D):
            if trained[d] < posted[d] and drafter_plans[d][trained[d]] in delivered and trained[d] <= min(trained):
                trained[d] += 1
                progress = True
    return "done" if all(n == steps for n in trained) and len(delivered) == steps * D else "deadlock"


@pytest.mark.parametrize("T, D", RATIOS)
@pytest.mark.parametrize("send_depth, recv_depth", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_fifo_channels_never_deadlock(T: int, D: int, send_depth: int, recv_depth: int) -> None:
    assert simulate(T, D, STEPS, send_depth, recv_depth) == "done"


def test_simulation_detects_bad_orders() -> None:
    # Running ahead on one drafter's stream: the target blocks on batch 3 (drafter 1, step 1)
    # while drafter 1 waits in the all-reduce for drafter 0, which needs batch 0.
    assert simulate(1, 2, 4, 1, 1, target_plans=[[1, 3, 0, 2, 5, 7, 4, 6]]) == "deadlock"
    # Reordering batches on one channel is caught as a mismatch, not a silent swap.
    assert simulate(1, 2, 4, 2, 2, target_plans=[[2, 1, 0, 3, 4, 5, 6, 7]]) == "mismatch"


def test_queue_depth_meter() -> None:
    meter = QueueDepthMeter()
    assert meter.summary() == {}
    for peer, depth in [(1, 0), (1, 2), (2, 1), (2, 1)]:
        meter.update(peer, depth)
    assert meter.summary("q") == {"q/mean": 1.0, "q/max": 2.0, "q/last_min": 1.0, "q/peer1": 1.0, "q/peer2": 1.0}
    meter.reset()
    assert meter.summary() == {}


# ---------------------------------------------------------------- per-node layouts: routed within each node

PER_NODE = [(2, 4, 1), (2, 4, 2), (3, 3, 1), (2, 5, 2), (3, 4, 3), (4, 2, 1)]  # (nodes, ranks per node, targets/node)


def _per_node(nodes: int, per_node: int, k: int):
    from dflash_ds.config import Config
    from dflash_ds.runtime.launch import job_layout

    cfg = Config()
    cfg.topology.targets_per_node = k
    return job_layout(cfg, nodes * per_node, per_node)  # drafters first, as the trainer lays them out


@pytest.mark.parametrize("nodes, per_node, k", PER_NODE)
def test_per_node_layout_routes_within_each_node(nodes: int, per_node: int, k: int) -> None:
    lay = _per_node(nodes, per_node, k)
    assert lay.node_local and "routed within each node" in lay.describe()
    T, D = lay.num_targets, lay.num_drafters
    loads = [0] * T
    for s in range(STEPS):
        for d in range(D):
            t = lay.route(s, d)
            assert lay.target_ranks[t] // per_node == lay.drafter_ranks[d] // per_node  # same node
            loads[t] += 1
    # The node's targets share its drafters' batches evenly (within one batch, per node).
    for node in range(nodes):
        mine = [loads[t] for t, r in enumerate(lay.target_ranks) if r // per_node == node]
        assert max(mine) - min(mine) <= 1


@pytest.mark.parametrize("nodes, per_node, k", PER_NODE)
@pytest.mark.parametrize("send_depth, recv_depth", [(1, 1), (2, 2)])
def test_per_node_routing_never_deadlocks(nodes: int, per_node: int, k: int, send_depth: int, recv_depth: int) -> None:
    lay = _per_node(nodes, per_node, k)
    T, D = lay.num_targets, lay.num_drafters
    # What the target worker serves: its batches in step order, drafters in order within a step.
    plans = [[s * D + d for s in range(STEPS) for d in range(D) if lay.route(s, d) == t] for t in range(T)]
    assert sorted(g for plan in plans for g in plan) == list(range(STEPS * D))
    assert simulate(T, D, STEPS, send_depth, recv_depth, target_plans=plans,
                    owner=lambda g: lay.route(g // D, g % D)) == "done"


def test_global_layout_routes_as_the_router() -> None:
    from dflash_ds.distributed.layout import make_layout

    lay = make_layout(7, 3)
    assert not lay.node_local
    assert [lay.route(s, d) for s in range(5) for d in range(4)] == [
        route(s * 4 + d, 3, 4).target_idx for s in range(5) for d in range(4)]
