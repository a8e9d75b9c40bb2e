"""Stopping with receives posted past the stop step: they never complete (no target sends them).

On NCCL `Work.wait()` makes the calling thread's CUDA stream wait for the transfer, so a wait on such a
receive would hold that stream (and the checkpoint's copies behind it) forever. The receiver polls
`is_completed()` instead (CUDA, or `poll=True` here on the CPU as the stand-in), never calls `wait()`,
and a bridge that still has posted receives at exit is aborted, not shut down.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from dflash_ds.distributed.bridge import AsyncSender, BridgeTimeoutError, Receiver
from dflash_ds.distributed.layout import make_layout
from dflash_ds.distributed.topology import RoleContext, shutdown
from dflash_ds.runtime.sources import BridgeSource
from test_bridge import OrderMatchedLoopback, make_batch


class Work:
    """A receive's Work: complete or never; counts the calls a stream-blocking wait() would be."""

    waits = 0

    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        Work.waits += 1
        if not self.done:
            time.sleep(timeout.total_seconds() if timeout else 0)
            raise RuntimeError("timed out")
        return True


class StoppedTargets(OrderMatchedLoopback):
    """The targets sent batches 0 and 1 and stopped: later receives are posted but never complete."""

    def recv(self, tensors, src, tag):
        if not self.wire.get((src, self.me)):
            return Work(done=False)
        super().recv(tensors, src, tag)
        return Work(done=True)


def stopped_receiver(poll: bool, timeout_s: float = 0.3) -> Receiver:
    group = StoppedTargets(me=0)
    sender = AsyncSender(group, depth=2)
    for g in range(2):
        sender.send(1, *make_batch(g), batch_id=g)
    sender.flush()
    group.me = 1
    specs = {g: [(k, t.dtype, tuple(t.shape)) for k, t in make_batch(g)[0].items()] for g in range(4)}
    return Receiver(group, [(g, 0, specs[g]) for g in range(4)], depth=2, timeout_s=timeout_s, poll=poll)


def test_receives_past_the_stop_step_are_polled_never_waited_for() -> None:
    Work.waits = 0
    receiver = stopped_receiver(poll=True)
    assert [next(receiver).batch_id for _ in range(2)] == [0, 1]
    assert receiver.posted() == 2  # batches 2 and 3: posted ahead, never to be sent
    t0 = time.monotonic()
    with pytest.raises(BridgeTimeoutError, match="did not finish within 0.3s"):
        next(receiver)
    assert time.monotonic() - t0 < 5
    assert Work.waits == 0  # not one wait(): nothing was queued on any stream


def test_waiting_receiver_is_what_held_the_stream() -> None:
    """Control: the waiting receiver (gloo's path, and NCCL's before polling) calls wait() on every receive,
    the one that never completes included: on NCCL each is a stream wait."""
    Work.waits = 0
    receiver = stopped_receiver(poll=False)
    assert [next(receiver).batch_id for _ in range(2)] == [0, 1]
    with pytest.raises(BridgeTimeoutError):
        next(receiver)
    assert Work.waits >= 5  # 2 batches x (header + payload) + the one that never completes


class Group:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def context(abort: bool) -> RoleContext:
    layout = make_layout(2, 1)
    return RoleContext(layout, 0, "drafter", 0, 1, Group(), dist.HashStore(), torch.device("cpu"), "gloo", 1.0,
                       abort_bridge=abort)


def gloo_pair(timeout_s: float) -> list:
    """A real gloo bridge group between two threads of this process (rank 0: a drafter, rank 1: a target)."""
    import datetime
    import threading

    from dflash_ds.distributed.backends import make_bridge

    store, groups = dist.HashStore(), [None, None]

    def build(rank: int) -> None:
        groups[rank] = make_bridge("gloo", store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    return groups


class Recording:
    """A real gloo group, recording its receives (by tag), abort and shutdown in `events`."""

    def __init__(self, group, events: list) -> None:
        self.group, self.events = group, events

    def recv(self, tensors, src, tag):
        self.events.append(f"recv {tag}")
        return self.group.recv(tensors, src, tag)

    def send(self, tensors, dst, tag):
        return self.group.send(tensors, dst, tag)

    def abort(self) -> None:
        self.events.append("abort")
        self.group.abort()

    def shutdown(self) -> None:
        self.events.append("shutdown")
        self.group.shutdown()


def test_stop_teardown_aborts_the_bridge_then_joins_the_receiver_then_destroys_the_role_group(monkeypatch):
    """A drafter stops after batches 0 and 1 with batches 2 and 3 posted ahead (a real gloo bridge; the real
    BridgeSource thread, close and topology.shutdown). The bridge is aborted before the role group is
    destroyed, the receiver thread has ended by then, and no receive is posted after the abort, though the
    target's batch 2 arrives late (it would free a slot for batch 4's receive)."""
    import threading

    drafter_pg, target_pg = gloo_pair(timeout_s=2.0)
    events: list[str] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the drafters' role group
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: (events.append("destroy role group"),
                                                                   real_destroy(*a)))
    ctx = RoleContext(make_layout(2, 1), 0, "drafter", 0, 1, Recording(drafter_pg, events), dist.HashStore(),
                      torch.device("cpu"), "gloo", 1.0, bridge_timeout_s=2.0)
    specs = {g: [(k, t.dtype, tuple(t.shape)) for k, t in make_batch(g)[0].items()] for g in range(6)}
    source = BridgeSource.__new__(BridgeSource)  # the real object, fed a hand schedule instead of a batch stream
    source.ctx, source.depth, source.q, source.receiver = ctx, 2, __import__("queue").Queue(maxsize=2), None
    source.pool = None
    source.thread = threading.Thread(target=source._work, args=([(g, 1, specs[g]) for g in range(6)],), daemon=True)
    source.thread.start()
    sender = AsyncSender(target_pg, depth=4, timeout_s=2.0)
    for g in range(2):
        sender.send(0, *make_batch(g), batch_id=g)
    assert [source.get().batch_id for _ in range(2)] == [0, 1]
    deadline = time.monotonic() + 10
    while source.receiver.posted() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # batches 2 and 3 posted ahead
    source.close()
    events.append("closed")

    def send_late() -> None:  # batch 2 in flight as the drafter leaves (refused, once the peer has aborted)
        with contextlib.suppress(RuntimeError):
            sender.send(0, *make_batch(2), batch_id=2)

    late = threading.Thread(target=send_late, daemon=True)
    late.start()
    late.join(5)
    source.thread.join(5)
    events.append(f"receiver thread {'alive' if source.thread.is_alive() else 'ended'}")
    ctx.store.add("dflash/shutdown", 1)  # the target has checked out
    shutdown(ctx, timeout_s=1)
    assert events.index("abort") < events.index("closed") < events.index("destroy role group"), events
    assert not [e for e in events[events.index("abort"):] if e.startswith("recv")], events
    assert "receiver thread ended" in events and events.count("abort") == 1 and "shutdown" not in events, events
    assert ctx.bridge is None  # aborted: shutdown left it alone


def test_a_drained_bridge_is_shut_down() -> None:
    ctx = context(abort=False)
    ctx.store.add("dflash/shutdown", 1)
    shutdown(ctx, timeout_s=1)
    assert ctx.bridge.calls == ["shutdown"]


def test_a_stopped_targets_sends_in_flight_abort_the_bridge():
    """A target that stops with batches in flight (no drafter will post their receives) aborts its group; a
    shutdown would wait on those sends. A sender with nothing in flight leaves the group alone."""
    drafter_pg, target_pg = gloo_pair(timeout_s=2.0)
    events: list[str] = []
    sender = AsyncSender(Recording(target_pg, events), depth=2, timeout_s=2.0)
    for g in range(2):
        sender.send(0, *make_batch(g), batch_id=g)  # gloo sends are rendezvous: in flight until received
    assert sender.in_flight() == 2
    assert sender.abort() == 2 and events == ["abort"] and sender.in_flight() == 0
    assert AsyncSender(Recording(drafter_pg, events), depth=2).abort() == 0 and events == ["abort"]


def test_bridge_deadlines_count_from_the_post_and_the_group_times_out_later():
    """NCCL's watchdog counts the group's timeout from each post; the bridge's own deadline must come first
    for its clear error to be seen. A receive posted ahead and awaited 2.5 s later (a long step) with a 2 s
    bridge timeout fails as soon as it is awaited (its deadline, post + 2 s, has passed), not 2 s later;
    the group's timeout is the bridge's plus the margin (60 s, or 5% above 1200 s: 1890 s at the default)."""
    from dflash_ds.distributed.bridge import group_timeout

    assert group_timeout(2.0).total_seconds() == 62.0 and group_timeout(1800.0).total_seconds() == 1890.0
    drafter_pg, _target_pg = gloo_pair(timeout_s=2.0)
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in make_batch(0)[0].items()]
    receiver = Receiver(drafter_pg, [(0, 1, specs)], depth=2, timeout_s=2.0)  # posts batch 0's receives now
    time.sleep(2.5)
    t0 = time.monotonic()
    with pytest.raises(BridgeTimeoutError, match="with rank 1 did not finish within 2s"):
        next(receiver)
    assert time.monotonic() - t0 < 1.0  # the deadline counted from the post (from the call: 2 s more)
