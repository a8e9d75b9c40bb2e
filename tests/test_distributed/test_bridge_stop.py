"""Stopping with receives posted past the stop step: they never complete (no target sends them).

On NCCL `Work.wait()` makes the calling thread's CUDA stream wait for the transfer, so a wait on such a
receive would hold that stream (and the checkpoint's copies behind it) forever. The receiver polls
`is_completed()` instead (CUDA, or `poll=True` here on the CPU as the stand-in), never calls `wait()`,
and a bridge that still has posted receives at exit is aborted, not shut down.
"""

from __future__ import annotations

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


def test_the_drafter_source_marks_a_bridge_with_posted_receives_and_exit_aborts_it() -> None:
    ctx = context(abort=False)
    source = BridgeSource.__new__(BridgeSource)  # its receiving thread is not needed to check close()
    source.ctx, source.receiver = ctx, stopped_receiver(poll=True)
    next(source.receiver), next(source.receiver)
    source.close()
    assert ctx.abort_bridge
    ctx.store.add("dflash/shutdown", 1)  # the peer (a target) has checked out
    shutdown(ctx, timeout_s=1)
    assert ctx.bridge.calls == ["abort"]


def test_a_drained_bridge_is_shut_down() -> None:
    ctx = context(abort=False)
    ctx.store.add("dflash/shutdown", 1)
    shutdown(ctx, timeout_s=1)
    assert ctx.bridge.calls == ["shutdown"]
