"""Hidden-state exchange between one target rank and one drafter rank over the bridge group.

Wire format (version 2). A batch is one fixed-size header, then its payload:

- header: int64[HEADER_SLOTS] on tag `2 * channel`;
- payload on tag `2 * channel + 1`: first, if any, one message packing every tensor of at
  most SMALL_BYTES (ids, masks, lengths: each at a 64-byte aligned offset, in header order),
  then each larger tensor (the hidden states) as its own message, in header order.
  Both sides derive this layout from the header (`payload_layout`). Packing matters: with
  gloo on CPU each message costs ~0.1 ms, several times the header's round trip.

Header and payload use different tags because the backend matches receives to
sends per (peer, tag) in posting order: with separate tags a drafter can post
the header receives of the next batches before it knows the shapes of the
current one (that is how `Receiver` prefetches). gloo sends are rendezvous:
data moves only once the receiver has posted the matching receive.

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
import math
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple, Protocol

import torch

HEADER_SLOTS = 128
MAGIC = 0x0DF1A5B
VERSION = 2
MAX_TENSORS = 8
MAX_DIMS = 4
MAX_META = 16  # 80 + 3 * 16 = 128 slots
NAME_BYTES = 24
KEY_BYTES = 16
_TENSOR_BASE, _TENSOR_SLOTS = 8, 9
SMALL_BYTES = 1 << 18  # tensors up to 256 KiB travel packed into one message
ALIGN = 64  # byte alignment of every tensor inside a packed message or a receive buffer
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


def _pack_ascii(text: str, nbytes: int) -> list[int]:
    raw = text.encode("ascii")
    if len(raw) > nbytes:
        raise ValueError(f"name {text!r} is longer than {nbytes} bytes")
    return list(struct.unpack(f"<{nbytes // 8}q", raw.ljust(nbytes, b"\0")))


def _unpack_ascii(slots: list[int]) -> str:
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
        h[o:o + _TENSOR_SLOTS] = _pack_ascii(name, NAME_BYTES) + [DTYPE_CODES[t.dtype], t.dim()] + dims
    for j, (key, value) in enumerate(meta.items()):
        o = _META_BASE + _META_SLOTS * j
        h[o:o + _META_SLOTS] = _pack_ascii(key, KEY_BYTES) + list(struct.unpack("<q", struct.pack("<d", value)))
    return torch.tensor(h, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[int, list[tuple[str, torch.dtype, tuple[int, ...]]], dict[str, float]]:
    """Inverse of `encode_header`: (batch id, [(name, dtype, shape)], meta)."""
    h = header.tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise BridgeError(f"bad bridge header (magic {h[0]:#x}, version {h[1]}): "
                          "sender and receiver disagree on the message order or the dflash-ds version")
    specs = []
    for i in range(h[3]):
        o = _TENSOR_BASE + _TENSOR_SLOTS * i
        name = _unpack_ascii(h[o:o + 3])
        code, ndim = h[o + 3], h[o + 4]
        specs.append((name, _CODE_DTYPES[code], tuple(h[o + 5:o + 5 + ndim])))
    meta = {}
    for j in range(h[4]):
        o = _META_BASE + _META_SLOTS * j
        meta[_unpack_ascii(h[o:o + 2])] = struct.unpack("<d", struct.pack("<q", h[o + 2]))[0]
    return h[2], specs, meta


def _tags(channel: int) -> tuple[int, int]:
    return 2 * channel, 2 * channel + 1


Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class PayloadLayout:
    """Where each tensor of a batch lies in one flat byte buffer, and which messages carry them."""

    offsets: list[int]  # byte offset of tensor i (header order)
    nbytes: list[int]
    small_end: int  # bytes [0, small_end) are the packed message of the small tensors (0: none)
    total: int
    large: list[int]  # indices of the tensors sent alone, in wire order


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def payload_layout(specs: list[Spec]) -> PayloadLayout:
    """The payload layout both sides derive from the header (see the wire format above)."""
    nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    small = [i for i, n in enumerate(nbytes) if n <= SMALL_BYTES]
    large = [i for i, n in enumerate(nbytes) if n > SMALL_BYTES]
    offsets, pos = [0] * len(specs), 0
    for i in small:
        offsets[i], pos = pos, pos + _round_up(nbytes[i], ALIGN)
    small_end = pos
    for i in large:
        offsets[i], pos = pos, pos + _round_up(nbytes[i], ALIGN)
    return PayloadLayout(offsets, nbytes, small_end, pos, large)


def _views(flat: torch.Tensor, specs: list[Spec], layout: PayloadLayout) -> dict[str, torch.Tensor]:
    """The batch's tensors as views of one flat uint8 buffer laid out by `layout`."""
    return {name: flat[o:o + n].view(dtype).view(shape)
            for (name, dtype, shape), o, n in zip(specs, layout.offsets, layout.nbytes)}


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
    # The Works keep the tensors alive, but the caller must not modify them in
    # place before the Works complete (the target allocates fresh ones per batch).
    meta = meta or {}
    payload = [t.contiguous() for t in tensors.values()]
    device = payload[0].device if payload else torch.device("cpu")
    header = encode_header(batch_id, tensors, meta).to(device)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in zip(tensors, payload)]
    layout = payload_layout(specs)
    messages = []
    if layout.small_end:  # one staging copy of the small tensors (a few KiB per batch)
        staging = torch.empty(layout.small_end, dtype=torch.uint8, device=device)
        for (_, dtype, shape), t, o, n in zip(specs, payload, layout.offsets, layout.nbytes):
            if n <= SMALL_BYTES:
                staging[o:o + n].view(dtype).view(shape).copy_(t)
        messages.append(staging)
    messages += [payload[i] for i in layout.large]
    htag, ptag = _tags(tag)
    works = [bridge.send([header], dst, htag)]
    works += [bridge.send([m], dst, ptag) for m in messages]
    return works


@dataclass
class _InFlight:
    dst: int
    batch_id: int
    works: list[Any]


class AsyncSender:
    """Keeps at most `depth` batches in flight (double buffering); waits on the oldest before posting more."""

    def __init__(self, bridge: BridgeGroup, depth: int = 2, timeout_s: float = 600.0,
                 meter: DepthSink | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.bridge, self.depth, self.timeout_s, self.meter = bridge, depth, timeout_s, meter
        self._in_flight: deque[_InFlight] = deque()
        self.last_block_s = 0.0  # how long the last send() waited for room: drafter-bound when > 0

    def send(self, dst: int, tensors: dict[str, torch.Tensor], meta: dict[str, float] | None,
             batch_id: int, tag: int = 0) -> None:
        """Post a batch to `dst`, first waiting for the oldest batch when `depth` are in flight."""
        t0 = time.monotonic()
        while len(self._in_flight) >= self.depth:
            self._retire(self._in_flight.popleft())
        self.last_block_s = time.monotonic() - t0
        works = send_batch(self.bridge, dst, tensors, meta, batch_id, tag)
        self._in_flight.append(_InFlight(dst, batch_id, works))
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


# ---------------------------------------------------------------- receiving


class BufferPool:
    """Receive buffers that go back into service once the consumer releases a batch.

    A fresh multi-MiB tensor per batch costs a page fault per 4 KiB page on CPU (glibc hands large
    blocks back to the OS on free), which made the exchange far slower than a raw receive into one
    reused tensor. With a pool, all tensors of a batch are views of one flat byte buffer; the
    consumer calls `release(batch.tensors)` when it is done with them and the buffer is handed out
    again for a later batch of at most its size. Thread-safe (the drafter receives on a thread).
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
        return _alloc_payload(specs, self.device, self)[0]


def _alloc_payload(specs: list[Spec], device: torch.device | str,
                   pool: BufferPool | None) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Receive space for a batch: its tensors (views of one buffer) and the messages to post into."""
    layout = payload_layout(specs)
    if pool is not None and layout.total:
        flat = pool.take(layout.total)
    else:  # no pool, or nothing to receive (an empty buffer the pool need not track)
        flat = torch.empty(layout.total, dtype=torch.uint8, device=device)
    tensors = _views(flat, specs, layout)
    messages = ([flat[:layout.small_end]] if layout.small_end else []) + \
        [tensors[specs[i][0]] for i in layout.large]
    return tensors, messages


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
    tensors, messages = _alloc_payload(specs, pool.device if pool is not None else device, pool)
    works = [bridge.recv([m], src, ptag) for m in messages]
    for w in works:
        _wait(w, deadline, src, f"receiving batch {batch_id}", timeout_s)
    return Batch(batch_id, tensors, meta)


@dataclass
class _Pending:
    batch_id: int
    src: int
    header: torch.Tensor
    header_work: Any
    tensors: dict[str, torch.Tensor] | None = None
    meta: dict[str, float] = field(default_factory=dict)
    works: list[Any] = field(default_factory=list)


class Receiver:
    """Receives a planned sequence of (batch_id, src) batches, keeping `depth` header receives posted ahead.

    Call `poll()` while training on a batch to start the payload transfer of
    any next batch whose header has already arrived (no background thread).
    """

    def __init__(self, bridge: BridgeGroup, schedule: Iterable[tuple[int, int]], depth: int = 2,
                 timeout_s: float = 600.0, tag: int = 0, device: torch.device | str = "cpu",
                 meter: DepthSink | None = None, pool: BufferPool | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.bridge, self.depth, self.timeout_s, self.device, self.meter = bridge, depth, timeout_s, device, meter
        self.pool = pool  # with a pool: release each batch's tensors to it once done with them
        self._schedule: Iterator[tuple[int, int]] = iter(schedule)
        self._exhausted = False
        self._tags = _tags(tag)
        self._pending: deque[_Pending] = deque()
        self.last_wait_s = 0.0  # how long the last next() blocked: target-bound when > 0
        self.poll()

    def __iter__(self) -> Receiver:
        return self

    def __next__(self) -> Batch:
        """The next scheduled batch; blocks until it has arrived (or times out)."""
        self.poll()
        if not self._pending:
            raise StopIteration
        head = self._pending[0]
        if self.meter is not None:
            # What the target has already produced for us at the moment we ask.
            self.meter.update(head.src, sum(p.header_work.is_completed() for p in self._pending))
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        if head.tensors is None:
            _wait(head.header_work, deadline, head.src, f"receiving the header of batch {head.batch_id}",
                  self.timeout_s)
            self._post_payload(head)
        for w in head.works:
            _wait(w, deadline, head.src, f"receiving batch {head.batch_id}", self.timeout_s)
        self.last_wait_s = time.monotonic() - t0
        self._pending.popleft()
        self.poll()
        assert head.tensors is not None
        return Batch(head.batch_id, head.tensors, head.meta)

    def poll(self) -> None:
        """Post header receives up to `depth` ahead and payload receives for headers that have arrived."""
        while len(self._pending) < self.depth and not self._exhausted:
            try:
                batch_id, src = next(self._schedule)
            except StopIteration:
                self._exhausted = True
                break
            header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
            work = self.bridge.recv([header], src, self._tags[0])
            self._pending.append(_Pending(batch_id, src, header, work))
        for p in self._pending:
            if p.tensors is not None:
                continue
            if not p.header_work.is_completed():
                break  # payload receives must be posted in batch order
            _wait(p.header_work, time.monotonic() + self.timeout_s, p.src, "receiving a batch header",
                  self.timeout_s)  # completed: returns at once or raises the peer's error
            self._post_payload(p)

    def _post_payload(self, p: _Pending) -> None:
        batch_id, specs, meta = decode_header(p.header.cpu())
        if batch_id != p.batch_id:
            raise BridgeError(f"bridge: expected batch {p.batch_id} from rank {p.src}, got batch {batch_id}: "
                              "the target and drafter routing plans disagree")
        p.tensors, messages = _alloc_payload(specs, self.device, self.pool)
        p.meta = meta
        p.works = [self.bridge.recv([m], p.src, self._tags[1]) for m in messages]
