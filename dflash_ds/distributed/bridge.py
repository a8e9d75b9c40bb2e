"""Hidden-state exchange between one target rank and one drafter rank over the bridge group.

A batch is two messages (what they hold: `payload.py`, wire format 3): a fixed-size header on
tag `2 * channel`, then one payload message holding every tensor of the batch on tag
`2 * channel + 1`.

Both sides post their messages in the same order, header i, payload i, header i+1, ...:
NCCL ignores tags and matches a pair's sends and receives purely by order, so a receiver
must never post the header of batch i+1 before the payload of batch i (`Receiver` posts
the next header right after the current payload). gloo matches per (peer, tag) in posting
order and its sends are rendezvous: data moves only once the receiver has posted the
matching receive.

A receive that times out raises `BridgeTimeoutError` naming the peer. With
gloo a timed-out pair is closed, so a timeout is fatal for that pair. Every deadline counts from the
message's post, as NCCL's watchdog counts the group's timeout; the group gets `group_timeout(timeout_s)`,
later by a margin, so the clear error here fires first (on NCCL, the watchdog would abort the rank with its
own error otherwise).

Teardown after a stop: `Receiver.close(abort)` stops posting and aborts the group in one step (no receive is
posted on an aborted group); `AsyncSender.abort()` drops sends no drafter will take.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Protocol

import torch

from dflash_ds.distributed.payload import (
    HEADER_SLOTS, BridgeError, BufferPool, Spec, alloc_payload, decode_header, describe_specs, encode_header,
    packed_empty, payload_buffer, payload_layout,
)


class BridgeTimeoutError(BridgeError, TimeoutError):
    """A bridge transfer did not finish in time."""


class Batch(NamedTuple):
    """One received batch."""

    batch_id: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, float]


class BridgeGroup(Protocol):
    """What the bridge needs from a group: the gloo and NCCL backend objects (`ProcessGroupGloo`, ...) fit."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any: ...


class DepthSink(Protocol):
    """Anything that records a queue depth per peer: `update(peer, depth)` after each send or receive."""

    def update(self, peer: int, depth: int) -> None: ...


# How much later than the bridge's own deadline the group's timeout expires. Both count from a message's post;
# the margin covers the error's way out after the deadline (the waiting thread hands it to the training loop,
# which names lost peers for up to 4 heartbeats, ~20 s, before it exits) and scheduling delays on a loaded
# host. At the default train.bridge_timeout_s 1800: group timeout 1890 s.
GROUP_TIMEOUT_MARGIN_S = 60.0
GROUP_TIMEOUT_MARGIN_FRAC = 0.05


def group_timeout(timeout_s: float) -> datetime.timedelta:
    """The bridge group's own timeout for a bridge deadline of `timeout_s`: later by the margin above."""
    return datetime.timedelta(seconds=timeout_s + max(GROUP_TIMEOUT_MARGIN_S, GROUP_TIMEOUT_MARGIN_FRAC * timeout_s))


def _tags(channel: int) -> tuple[int, int]:
    return 2 * channel, 2 * channel + 1


# ---------------------------------------------------------------- waiting


def _wait(work: Any, deadline: float, peer: int, what: str, timeout_s: float) -> None:
    """Wait for one Work until `deadline` (time.monotonic); raise a bridge error naming the peer."""
    remaining = max(deadline - time.monotonic(), 1e-3)
    try:
        # Work.wait(timeout) is honoured by gloo and NCCL; a backend that
        # ignores it and returns False is treated as a timeout too.
        done = work.wait(datetime.timedelta(seconds=remaining))
    except Exception as e:  # the backends raise plain RuntimeError for both cases
        if time.monotonic() >= deadline - 1e-3 or "timed out" in str(e).lower():
            raise BridgeTimeoutError(
                f"bridge: {what} with rank {peer} did not finish within {timeout_s:g}s; "
                f"is rank {peer} alive and routed to this rank?") from e
        raise BridgeError(f"bridge: {what} with rank {peer} failed: {e}") from e
    if done is False:
        raise BridgeTimeoutError(f"bridge: {what} with rank {peer} did not finish within {timeout_s:g}s")


def _poll(work: Any, deadline: float, peer: int, what: str, timeout_s: float,
          closed: threading.Event | None = None) -> None:
    """Wait for one Work by polling `is_completed()` until `deadline`: nothing is queued on any stream.

    On NCCL, `Work.wait()` makes the calling thread's current CUDA stream wait for the transfer. A
    receive posted ahead for a batch the targets never send (they stop at the agreed stop step)
    would then hold that stream forever, and every later kernel or copy on it (the checkpoint's)
    queues behind it. Polling keeps a receive that never completes this thread's business alone; a
    completed NCCL receive's data is in place, so the consumer reads it without any stream wait.
    """
    while not work.is_completed():
        if closed is not None and closed.is_set():
            raise BridgeError(f"bridge: {what} with rank {peer}: the receiver was closed (the run stopped)")
        if time.monotonic() > deadline:
            raise BridgeTimeoutError(f"bridge: {what} with rank {peer} did not finish within {timeout_s:g}s; "
                                     f"is rank {peer} alive and routed to this rank?")
        time.sleep(0.0002)
    failed = work.exception() if hasattr(work, "exception") else None
    if failed is not None:
        raise BridgeError(f"bridge: {what} with rank {peer} failed: {failed}")


def wait_all(works: Iterable[Any], peer: int, timeout_s: float, what: str = "transfer",
             posted_at: float | None = None) -> None:
    """Wait for a list of Works with one shared deadline, `timeout_s` after their post (default: now)."""
    deadline = (time.monotonic() if posted_at is None else posted_at) + timeout_s
    for w in works:
        _wait(w, deadline, peer, what, timeout_s)


# ---------------------------------------------------------------- sending


def send_batch(bridge: BridgeGroup, dst: int, tensors: dict[str, torch.Tensor],
               meta: dict[str, float] | None, batch_id: int, tag: int = 0) -> list[Any]:
    """Post a batch's header and payload sends to global rank `dst`; returns the Works (asynchronous)."""
    return _post_batch(bridge, dst, tensors, meta, batch_id, tag)[0]


def _post_batch(bridge: BridgeGroup, dst: int, tensors: dict[str, torch.Tensor], meta: dict[str, float] | None,
                batch_id: int, tag: int, pool: BufferPool | None = None) -> tuple[list[Any], torch.Tensor | None]:
    """`send_batch`, also returning the payload message (the batch's own buffer, or a staging copy from `pool`)."""
    # The Works keep the message alive, but the caller must not modify the tensors in place
    # before the Works complete.
    meta = meta or {}
    payload = [t.contiguous() for t in tensors.values()]
    device = payload[0].device if payload else torch.device("cpu")
    header = encode_header(batch_id, tensors, meta)
    if device.type == "cuda":  # a pinned staging copy: the header goes up without stalling the host
        header = header.pin_memory().to(device, non_blocking=True)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in zip(tensors, payload)]
    layout = payload_layout(specs)
    message = payload_buffer(payload, layout)
    if message is None and layout.total:  # not built in place: one staging copy, on the payload's device
        same = pool is not None and torch.device(pool.device) == device
        staged, message = alloc_payload(specs, device, pool if same else None)
        for view, t in zip(staged.values(), payload):
            view.copy_(t)
    htag, ptag = _tags(tag)
    works = [bridge.send([header], dst, htag)]
    if message is not None:
        works.append(bridge.send([message], dst, ptag))
    return works, message


@dataclass
class _InFlight:
    dst: int
    batch_id: int
    works: list[Any]
    message: torch.Tensor | None  # the payload buffer: back to the pool once sent
    posted_at: float  # time.monotonic() at the post: the deadline counts from here, as the group's timeout does


class AsyncSender:
    """Keeps at most `depth` batches in flight (double buffering); waits on the oldest before posting more.

    A producer that builds each batch with `empty(specs)` fills pooled buffers laid out as the
    payload: nothing is copied to send them, and each buffer serves a later batch once sent.
    """

    def __init__(self, bridge: BridgeGroup, depth: int = 2, timeout_s: float = 600.0,
                 meter: DepthSink | None = None, device: torch.device | str = "cpu") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.bridge, self.depth, self.timeout_s, self.meter = bridge, depth, timeout_s, meter
        self.pool = BufferPool(device, max_free=depth + 1)
        self._in_flight: deque[_InFlight] = deque()
        self.last_block_s = 0.0  # how long the last send() waited for room: drafter-bound when > 0

    def empty(self, specs: list[Spec]) -> dict[str, torch.Tensor]:
        """Tensors to fill for the next batch: views of a pooled payload buffer (sent as is, then reused)."""
        return packed_empty(specs, self.pool.device, self.pool)

    def send(self, dst: int, tensors: dict[str, torch.Tensor], meta: dict[str, float] | None,
             batch_id: int, tag: int = 0) -> None:
        """Post a batch to `dst`, first waiting for the oldest batch when `depth` are in flight."""
        t0 = time.monotonic()
        while len(self._in_flight) >= self.depth:
            self._retire(self._in_flight.popleft())
        self.last_block_s = time.monotonic() - t0
        posted_at = time.monotonic()
        works, message = _post_batch(self.bridge, dst, tensors, meta, batch_id, tag, self.pool)
        self._in_flight.append(_InFlight(dst, batch_id, works, message, posted_at))
        if self.meter is not None:
            self.meter.update(dst, self.in_flight(dst))

    def in_flight(self, dst: int | None = None) -> int:
        """Batches posted (to `dst`, or to anyone) whose sends have not all completed."""
        return sum(1 for f in self._in_flight
                   if (dst is None or f.dst == dst) and not all(w.is_completed() for w in f.works))

    def flush(self) -> None:
        """Wait until every posted batch has been delivered."""
        while self._in_flight:
            self._retire(self._in_flight.popleft())

    def abort(self) -> int:
        """After a stop: abort the group if sends are still in flight (no drafter will post their receives, and
        shutting the group down would wait on them); returns how many batches were dropped."""
        dropped = self.in_flight()
        if dropped:
            self.bridge.abort()
        self._in_flight.clear()
        return dropped

    def _retire(self, old: _InFlight) -> None:
        # A plain wait: gloo marks a send complete only inside wait(), so is_completed() cannot be polled.
        wait_all(old.works, old.dst, self.timeout_s, f"sending batch {old.batch_id}", old.posted_at)
        if old.message is not None:  # a no-op unless the buffer came from the pool
            self.pool.release({"payload": old.message})


# ---------------------------------------------------------------- receiving


def recv_batch(bridge: BridgeGroup, src: int, timeout_s: float, tag: int = 0,
               device: torch.device | str = "cpu", pool: BufferPool | None = None) -> Batch:
    """Blocking receive of one batch from global rank `src` (header, then payload).

    With `pool`, the tensors are views of a pooled buffer: `pool.release(batch.tensors)` when done.
    """
    htag, ptag = _tags(tag)
    header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)
    deadline = time.monotonic() + timeout_s
    _wait(bridge.recv([header], src, htag), deadline, src, "receiving a batch header", timeout_s)
    batch_id, specs, meta = decode_header(header.cpu())
    tensors, message = alloc_payload(specs, pool.device if pool is not None else device, pool)
    if message is not None:
        _wait(bridge.recv([message], src, ptag), deadline, src, f"receiving batch {batch_id}", timeout_s)
    return Batch(batch_id, tensors, meta)


@dataclass
class _Pending:
    batch_id: int
    src: int
    header: torch.Tensor
    header_work: Any
    planned: list[Spec] | None  # the payload's specs when the schedule knows them
    tensors: dict[str, torch.Tensor] | None = None  # set once the payload receive is posted
    work: Any = None  # the payload receive (None: not posted yet, or an empty payload)
    meta: dict[str, float] | None = None  # set once the header has been read
    posted_at: float = 0.0  # when the header receive was posted: its deadline counts from here
    payload_posted_at: float = 0.0  # when the payload receive was


class Receiver:
    """Receives a scheduled sequence of batches, posting every receive as early as the order allows.

    `schedule` yields (batch_id, src) or (batch_id, src, specs). Receives are posted in the
    sender's order, header i, payload i, header i+1 (NCCL matches a pair's messages by order
    alone). When the schedule gives a batch's payload specs (the trainer derives them from the
    shared batch stream: `wire.payload_specs`), its header and payload receives are posted
    together, up to `depth` batches ahead, so the link never waits for the drafter; the header
    is then only checked against the plan. Otherwise the payload receive is posted once the
    header has arrived, and the next header right behind it. Payloads land in `pool` buffers if
    given (release each batch's tensors to it when done). `poll()` (called by `__next__`, or by
    the consumer mid-step) posts what has become possible without blocking; with gloo, whose
    receives report completion only inside `wait()`, an unplanned payload is posted on the next
    `__next__`. On CUDA (or with `poll=True`) completion is polled, never waited for (`_poll`):
    receives posted past the run's stop step cannot hold the training stream.
    """

    def __init__(self, bridge: BridgeGroup, schedule: Iterable[tuple[int, int] | tuple[int, int, list[Spec]]],
                 depth: int = 2, timeout_s: float = 600.0, tag: int = 0, device: torch.device | str = "cpu",
                 meter: DepthSink | None = None, pool: BufferPool | None = None, poll: bool | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.bridge, self.depth, self.timeout_s, self.device, self.meter = bridge, depth, timeout_s, device, meter
        # gloo marks a receive complete only inside wait(): poll only where completion is observable (NCCL).
        self._await = _poll if (torch.device(device).type == "cuda" if poll is None else poll) else _wait
        self.pool = pool
        self._schedule = iter(schedule)
        self._exhausted = False
        self._tags = _tags(tag)
        self._pending: deque[_Pending] = deque()  # receives posted, in batch order
        self.last_wait_s = 0.0  # how long the last next() blocked: target-bound when > 0
        # close() and a post exclude each other: once closed (and the group aborted), nothing more is posted.
        self._lock, self.closed = threading.Lock(), threading.Event()
        self.poll()

    def __iter__(self) -> Receiver:
        return self

    def __next__(self) -> Batch:
        """The next scheduled batch; blocks until it has arrived (or times out)."""
        t0 = time.monotonic()
        self.poll()
        if not self._pending:
            raise StopIteration
        head = self._pending[0]
        if self.meter is not None:  # what the target had already produced when we asked
            self.meter.update(head.src, sum(p.meta is not None or p.header_work.is_completed() for p in self._pending))
        if head.meta is None:
            self._read_header(head, head.posted_at + self.timeout_s)
            self.poll()  # an unplanned payload was just posted: the next header may follow it
        if head.work is not None:
            self._wait_for(head.work, head.payload_posted_at + self.timeout_s, head.src,
                           f"receiving batch {head.batch_id}")
        self.last_wait_s = time.monotonic() - t0
        self._pending.popleft()
        self.poll()
        assert head.tensors is not None and head.meta is not None
        return Batch(head.batch_id, head.tensors, head.meta)

    def posted(self) -> int:
        """Receives posted that have not been handed out (at exit: ones no target will ever match)."""
        return len(self._pending)

    def close(self, abort=None) -> None:
        """Post nothing more; with `abort` (the group's abort) and receives still posted, call it in the same
        step, so no receive can be posted on the aborted group. A polling wait then ends at once; a gloo wait
        (completion is seen only inside wait()) ends at its deadline or when its batch arrives."""
        with self._lock:
            self.closed.set()
            if abort is not None and self._pending:
                abort()

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        with self._lock:
            if self.closed.is_set():
                raise BridgeError(f"bridge: no receive from rank {src} after the receiver was closed (the run stopped)")
            return self.bridge.recv(tensors, src, tag)

    def _wait_for(self, work: Any, deadline: float, peer: int, what: str) -> None:
        if self._await is _poll:
            _poll(work, deadline, peer, what, self.timeout_s, self.closed)
        else:
            _wait(work, deadline, peer, what, self.timeout_s)

    def poll(self) -> None:
        """Post every receive the order and `depth` allow now (never blocks)."""
        while True:
            last = self._pending[-1] if self._pending else None
            if last is not None and last.tensors is None:  # an unplanned payload not yet posted
                if not last.header_work.is_completed():
                    return  # nothing may be posted behind it before it
                self._read_header(last, last.posted_at + self.timeout_s)  # arrived: returns at once
                continue
            if self._exhausted or len(self._pending) >= self.depth:
                return
            try:
                item = next(self._schedule)
            except StopIteration:
                self._exhausted = True
                return
            batch_id, src = item[0], item[1]
            planned = list(item[2]) if len(item) > 2 else None
            header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
            posted_at = time.monotonic()
            p = _Pending(batch_id, src, header, self._recv([header], src, self._tags[0]), planned, posted_at=posted_at)
            self._pending.append(p)
            if planned is not None:
                self._post_payload(p, planned)

    def _post_payload(self, p: _Pending, specs: list[Spec]) -> None:
        p.tensors, message = alloc_payload(specs, self.device, self.pool)
        p.payload_posted_at = time.monotonic()
        p.work = self._recv([message], p.src, self._tags[1]) if message is not None else None

    def _read_header(self, p: _Pending, deadline: float) -> None:
        """Wait for a batch's header and check it; post its payload receive if the schedule did not plan it."""
        self._wait_for(p.header_work, deadline, p.src, f"receiving the header of batch {p.batch_id}")
        got_id, specs, meta = decode_header(p.header.cpu())
        if got_id != p.batch_id:
            raise BridgeError(f"bridge: expected batch {p.batch_id} from rank {p.src}, got batch {got_id}: "
                              "the target and drafter routing plans disagree")
        if p.planned is None:
            self._post_payload(p, specs)
        elif specs != p.planned:
            raise BridgeError(f"bridge: batch {p.batch_id} from rank {p.src} is {describe_specs(specs)}, but this rank "
                              f"planned {describe_specs(p.planned)}: the target and drafter disagree on the batch's shapes "
                              "(batch stream, target layers or dtype)")
        p.meta = meta
