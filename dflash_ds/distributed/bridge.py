"""Hidden-state exchange between one target rank and one drafter rank over the bridge group.

Wire format (version 3). A batch is two messages:

- header: int64[HEADER_SLOTS] on tag `2 * channel`;
- payload: one message on tag `2 * channel + 1` holding every tensor of the batch, each at a
  64-byte aligned offset, in header order (`payload_layout`, derived from the header by both
  sides). A target that builds its batch in place (`packed_empty`, `AsyncSender.empty`) sends
  it without a copy; other tensors are packed into one staging buffer first.

One payload message per batch matters: every gloo message costs a notification round trip
(the receiver announces the receive, then the sender writes), about 0.1-0.4 ms on shared CPU
cores.

Both sides post their messages in the same order, header i, payload i, header i+1, ...:
NCCL ignores tags and matches a pair's sends and receives purely by order, so a receiver
must never post the header of batch i+1 before the payload of batch i (`Receiver` posts
the next header right after the current payload). gloo matches per (peer, tag) in posting
order and its sends are rendezvous: data moves only once the receiver has posted the
matching receive.

Header slots (the header is self-describing, so the bridge carries any dict of
tensors and any float metadata, e.g. target-side timings):

- 0 MAGIC, 1 VERSION, 2 batch id, 3 number of tensors, 4 number of meta values;
- 8 + 9 * i: tensor i as name (3 slots: 24 ASCII bytes, NUL padded),
  dtype code, ndim, then 4 dims (unused dims 0), for i < MAX_TENSORS;
- 80 + 3 * j: meta value j as key (2 slots: 16 ASCII bytes), then the value's
  float64 bit pattern, for j < MAX_META.

A receive that times out raises `BridgeTimeoutError` naming the peer. With
gloo a timed-out pair is closed, so a timeout is fatal for that pair.
"""

from __future__ import annotations

import datetime
import functools
import math
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Protocol

import torch

HEADER_SLOTS = 128
MAGIC = 0x0DF1A5B
VERSION = 3
MAX_TENSORS = 8
MAX_DIMS = 4
MAX_META = 16  # 80 + 3 * 16 = 128 slots
NAME_BYTES = 24
KEY_BYTES = 16
_TENSOR_BASE, _TENSOR_SLOTS = 8, 9
ALIGN = 64  # byte alignment of every tensor inside the payload message and its buffers
_META_BASE, _META_SLOTS = 80, 3

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3,
    torch.int64: 4, torch.int32: 5, torch.int16: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class BridgeError(RuntimeError):
    """A bridge transfer failed: the peer is gone or sent something unexpected."""


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
    """Anything that records a queue depth per peer (see router.QueueDepthMeter)."""

    def update(self, peer: int, depth: int) -> None: ...


# ---------------------------------------------------------------- header


@functools.lru_cache(maxsize=256)  # names and keys repeat every batch
def _pack_ascii(text: str, nbytes: int) -> list[int]:
    raw = text.encode("ascii")
    if len(raw) > nbytes:
        raise ValueError(f"name {text!r} is longer than {nbytes} bytes")
    return list(struct.unpack(f"<{nbytes // 8}q", raw.ljust(nbytes, b"\0")))


@functools.lru_cache(maxsize=256)
def _unpack_ascii(slots: tuple[int, ...]) -> str:
    return struct.pack(f"<{len(slots)}q", *slots).rstrip(b"\0").decode("ascii")


def encode_header(batch_id: int, tensors: dict[str, torch.Tensor], meta: dict[str, float]) -> torch.Tensor:
    """The int64[HEADER_SLOTS] header describing a batch (on CPU)."""
    if len(tensors) > MAX_TENSORS or len(meta) > MAX_META:
        raise ValueError(f"a batch carries at most {MAX_TENSORS} tensors and {MAX_META} meta values, "
                         f"got {len(tensors)} and {len(meta)}")
    h = [0] * HEADER_SLOTS
    h[0:5] = [MAGIC, VERSION, int(batch_id), len(tensors), len(meta)]
    for i, (name, t) in enumerate(tensors.items()):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPE_CODES:
            raise ValueError(f"tensor {name!r}: {t.dim()} dims of {t.dtype} cannot cross the bridge "
                             f"(at most {MAX_DIMS} dims of {sorted(map(str, DTYPE_CODES))})")
        dims = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        o = _TENSOR_BASE + _TENSOR_SLOTS * i
        h[o:o + _TENSOR_SLOTS] = [*_pack_ascii(name, NAME_BYTES), DTYPE_CODES[t.dtype], t.dim(), *dims]
    for j, (key, value) in enumerate(meta.items()):
        o = _META_BASE + _META_SLOTS * j
        h[o:o + _META_SLOTS] = [*_pack_ascii(key, KEY_BYTES), *struct.unpack("<q", struct.pack("<d", value))]
    # from bytes: a quarter of the cost of torch.tensor(list) (it is paid per batch, on the critical path)
    return torch.frombuffer(bytearray(struct.pack(f"<{HEADER_SLOTS}q", *h)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[int, list[tuple[str, torch.dtype, tuple[int, ...]]], dict[str, float]]:
    """Inverse of `encode_header`: (batch id, [(name, dtype, shape)], meta)."""
    h = header.tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise BridgeError(f"bad bridge header (magic {h[0]:#x}, version {h[1]}): "
                          "sender and receiver disagree on the message order or the dflash-ds version")
    specs = []
    for i in range(h[3]):
        o = _TENSOR_BASE + _TENSOR_SLOTS * i
        name = _unpack_ascii(tuple(h[o:o + 3]))
        code, ndim = h[o + 3], h[o + 4]
        specs.append((name, _CODE_DTYPES[code], tuple(h[o + 5:o + 5 + ndim])))
    meta = {}
    for j in range(h[4]):
        o = _META_BASE + _META_SLOTS * j
        meta[_unpack_ascii(tuple(h[o:o + 2]))] = struct.unpack("<d", struct.pack("<q", h[o + 2]))[0]
    return h[2], specs, meta


def _tags(channel: int) -> tuple[int, int]:
    return 2 * channel, 2 * channel + 1


Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class PayloadLayout:
    """Where each tensor of a batch lies in the payload message (one flat byte buffer)."""

    offsets: list[int]  # byte offset of tensor i (header order)
    nbytes: list[int]
    total: int  # bytes of the message: the last tensor's end rounded up to ALIGN


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def payload_layout(specs: list[Spec]) -> PayloadLayout:
    """The payload layout both sides derive from the header: tensors in order, each ALIGN-aligned."""
    nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    offsets, pos = [], 0
    for n in nbytes:
        offsets.append(pos)
        pos += _round_up(n, ALIGN)
    return PayloadLayout(offsets, nbytes, pos)


def _views(flat: torch.Tensor, specs: list[Spec], layout: PayloadLayout) -> dict[str, torch.Tensor]:
    """The batch's tensors as views of one flat uint8 buffer laid out by `layout`."""
    # set_ on the storage: half the cost of slice + view + view, paid per batch (offsets are ALIGN-aligned,
    # so each is a whole number of elements)
    storage, base = flat.untyped_storage(), flat.storage_offset()
    return {name: torch.empty(0, dtype=dtype, device=flat.device).set_(storage, (base + o) // dtype.itemsize, shape)
            for (name, dtype, shape), o in zip(specs, layout.offsets)}


def packed_empty(specs: list[Spec], device: torch.device | str = "cpu",
                 pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
    """Empty tensors for `specs` laid out as the payload message: filled in place, they are sent without a copy."""
    return _alloc_payload(specs, device, pool)[0]


def _alloc_payload(specs: list[Spec], device: torch.device | str,
                   pool: BufferPool | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Space for a batch: its tensors (views of one buffer, from `pool` if given) and the payload message."""
    layout = payload_layout(specs)
    if pool is not None and layout.total:
        flat = pool.take(layout.total)
    else:  # no pool, or nothing to move (an empty buffer the pool need not track)
        flat = torch.empty(layout.total, dtype=torch.uint8, device=device)
    return _views(flat, specs, layout), (flat[:layout.total] if layout.total else None)


def _payload_buffer(tensors: list[torch.Tensor], layout: PayloadLayout) -> torch.Tensor | None:
    """The uint8 buffer under `tensors` when they already lie in one storage exactly as `layout` places them."""
    if not tensors or layout.total == 0:
        return None
    storage = tensors[0].untyped_storage()
    base = tensors[0].data_ptr() - layout.offsets[0]
    start = base - storage.data_ptr()
    if start < 0 or start + layout.total > storage.nbytes():
        return None
    for t, o in zip(tensors, layout.offsets):
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != base + o or not t.is_contiguous():
            return None
    return torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, start, (layout.total,))


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


def wait_all(works: Iterable[Any], peer: int, timeout_s: float, what: str = "transfer") -> None:
    """Wait for a list of Works with one shared deadline."""
    deadline = time.monotonic() + timeout_s
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
    header = encode_header(batch_id, tensors, meta).to(device)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in zip(tensors, payload)]
    layout = payload_layout(specs)
    message = _payload_buffer(payload, layout)
    if message is None and layout.total:  # not built in place: one staging copy, on the payload's device
        same = pool is not None and torch.device(pool.device) == device
        staged, message = _alloc_payload(specs, device, pool if same else None)
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
        works, message = _post_batch(self.bridge, dst, tensors, meta, batch_id, tag, self.pool)
        self._in_flight.append(_InFlight(dst, batch_id, works, message))
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

    def _retire(self, old: _InFlight) -> None:
        # A plain wait: gloo marks a send complete only inside wait(), so is_completed() cannot be polled.
        wait_all(old.works, old.dst, self.timeout_s, f"sending batch {old.batch_id}")
        if old.message is not None:  # a no-op unless the buffer came from the pool
            self.pool.release({"payload": old.message})


# ---------------------------------------------------------------- buffers and receiving


class BufferPool:
    """Payload buffers that go back into service once a batch is done with.

    A fresh multi-MiB tensor per batch costs a page fault per 4 KiB page on CPU (glibc hands large
    blocks back to the OS on free), which made the exchange far slower than a raw transfer from and
    into one reused tensor. With a pool, all tensors of a batch are views of one flat byte buffer;
    `release(tensors)` hands the buffer out again for a later batch of at most its size. The
    drafter releases a received batch after its step; `AsyncSender` releases a sent one once its
    send completed. Thread-safe (the drafter receives on a thread).
    """

    ALIGN = ALIGN

    def __init__(self, device: torch.device | str = "cpu", max_free: int = 4) -> None:
        self.device, self.max_free = torch.device(device), max_free
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # new buffers made (the rest were reused)
        self.reuses = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        """nbytes rounded up to 1/8 of its power of two (at most 12.5% slack), at least ALIGN."""
        n = max(nbytes, ALIGN)
        return _round_up(n, max(1 << max(n.bit_length() - 4, 0), ALIGN))

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` (the smallest free one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # by index: list.remove would compare tensors elementwise
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self.reuses += 1
            else:
                buf = torch.empty(self.size_class(nbytes), dtype=torch.uint8, device=self.device)
                self.allocations += 1
            self._leased[buf.data_ptr()] = buf
            return buf

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        """Give back the buffer under a batch's tensors; the tensors must not be used afterwards."""
        with self._lock:
            for ptr in {t.untyped_storage().data_ptr() for t in tensors.values()}:
                buf = self._leased.pop(ptr, None)
                if buf is not None:
                    self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self.max_free:]  # keep the largest few

    def tensors(self, specs: list[Spec]) -> dict[str, torch.Tensor]:
        """Empty tensors for `specs`, all views of one pooled buffer laid out as the payload."""
        return packed_empty(specs, self.device, self)


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
    tensors, message = _alloc_payload(specs, pool.device if pool is not None else device, pool)
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


class Receiver:
    """Receives a scheduled sequence of batches, posting every receive as early as the order allows.

    `schedule` yields (batch_id, src) or (batch_id, src, specs). Receives are posted in the
    sender's order, header i, payload i, header i+1 (NCCL matches a pair's messages by order
    alone). When the schedule gives a batch's payload specs (the trainer derives them from the
    shared data plan: `wire.payload_specs`), its header and payload receives are posted
    together, up to `depth` batches ahead, so the link never waits for the drafter; the header
    is then only checked against the plan. Otherwise the payload receive is posted once the
    header has arrived, and the next header right behind it. Payloads land in `pool` buffers if
    given (release each batch's tensors to it when done). `poll()` (called by `__next__`, or by
    the consumer mid-step) posts what has become possible without blocking; with gloo, whose
    receives report completion only inside `wait()`, an unplanned payload is posted on the next
    `__next__`.
    """

    def __init__(self, bridge: BridgeGroup, schedule: Iterable[tuple[int, int] | tuple[int, int, list[Spec]]],
                 depth: int = 2, timeout_s: float = 600.0, tag: int = 0, device: torch.device | str = "cpu",
                 meter: DepthSink | None = None, pool: BufferPool | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.bridge, self.depth, self.timeout_s, self.device, self.meter = bridge, depth, timeout_s, device, meter
        self.pool = pool
        self._schedule = iter(schedule)
        self._exhausted = False
        self._tags = _tags(tag)
        self._pending: deque[_Pending] = deque()  # receives posted, in batch order
        self.last_wait_s = 0.0  # how long the last next() blocked: target-bound when > 0
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
            self._read_header(head, t0 + self.timeout_s)
            self.poll()  # an unplanned payload was just posted: the next header may follow it
        if head.work is not None:
            _wait(head.work, t0 + self.timeout_s, head.src, f"receiving batch {head.batch_id}", self.timeout_s)
        self.last_wait_s = time.monotonic() - t0
        self._pending.popleft()
        self.poll()
        assert head.tensors is not None and head.meta is not None
        return Batch(head.batch_id, head.tensors, head.meta)

    def poll(self) -> None:
        """Post every receive the order and `depth` allow now (never blocks)."""
        while True:
            last = self._pending[-1] if self._pending else None
            if last is not None and last.tensors is None:  # an unplanned payload not yet posted
                if not last.header_work.is_completed():
                    return  # nothing may be posted behind it before it
                self._read_header(last, time.monotonic() + self.timeout_s)  # arrived: returns at once
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
            p = _Pending(batch_id, src, header, self.bridge.recv([header], src, self._tags[0]), planned)
            self._pending.append(p)
            if planned is not None:
                self._post_payload(p, planned)

    def _post_payload(self, p: _Pending, specs: list[Spec]) -> None:
        p.tensors, message = _alloc_payload(specs, self.device, self.pool)
        p.work = self.bridge.recv([message], p.src, self._tags[1]) if message is not None else None

    def _read_header(self, p: _Pending, deadline: float) -> None:
        """Wait for a batch's header and check it; post its payload receive if the schedule did not plan it."""
        _wait(p.header_work, deadline, p.src, f"receiving the header of batch {p.batch_id}", self.timeout_s)
        got_id, specs, meta = decode_header(p.header.cpu())
        if got_id != p.batch_id:
            raise BridgeError(f"bridge: expected batch {p.batch_id} from rank {p.src}, got batch {got_id}: "
                              "the target and drafter routing plans disagree")
        if p.planned is None:
            self._post_payload(p, specs)
        elif specs != p.planned:
            raise BridgeError(f"bridge: batch {p.batch_id} from rank {p.src} is {describe_specs(specs)}, but this rank "
                              f"planned {describe_specs(p.planned)}: the target and drafter disagree on the batch's shapes "
                              "(data plan, target layers or dtype)")
        p.meta = meta


def describe_specs(specs: list[Spec]) -> str:
    """Specs for an error message: "input_ids int64[2, 3], context bfloat16[2, 3, 640]"."""
    return ", ".join(f"{name} {str(dtype).removeprefix('torch.')}{list(shape)}" for name, dtype, shape in specs)
