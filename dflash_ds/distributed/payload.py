"""What a batch looks like on the bridge (wire format 3): its header, and its payload laid out in one buffer.

A batch is two messages (`bridge.py` moves them):

- header: int64[HEADER_SLOTS], self-describing, so the bridge carries any dict of tensors and
  any float metadata (e.g. target-side timings);
- payload: one message holding every tensor of the batch, each at a 64-byte aligned offset, in
  header order (`payload_layout`, derived from the header by both sides). A target that builds
  its batch in place (`packed_empty`, `bridge.AsyncSender.empty`) sends it without a copy;
  other tensors are packed into one staging buffer first.

One payload message per batch matters: every gloo message costs a notification round trip
(the receiver announces the receive, then the sender writes), about 0.1-0.4 ms on shared CPU
cores. Payload buffers are reused through a `BufferPool` (a fresh multi-MiB tensor per batch
page-faults on CPU).

Header slots:

- 0 MAGIC, 1 VERSION, 2 batch id, 3 number of tensors, 4 number of meta values;
- 8 + 9 * i: tensor i as name (3 slots: 24 ASCII bytes, NUL padded),
  dtype code, ndim, then 4 dims (unused dims 0), for i < MAX_TENSORS;
- 80 + 3 * j: meta value j as key (2 slots: 16 ASCII bytes), then the value's
  float64 bit pattern, for j < MAX_META.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any

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

Spec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one tensor of a batch


class BridgeError(RuntimeError):
    """A bridge transfer failed: the peer is gone or sent something unexpected."""


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


def decode_header(header: torch.Tensor) -> tuple[int, list[Spec], dict[str, float]]:
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


# ---------------------------------------------------------------- payload layout


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
    return alloc_payload(specs, device, pool)[0]


def alloc_payload(specs: list[Spec], device: torch.device | str,
                  pool: BufferPool | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Space for a batch: its tensors (views of one buffer, from `pool` if given) and the payload message."""
    layout = payload_layout(specs)
    if pool is not None and layout.total:
        flat = pool.take(layout.total)
    else:  # no pool, or nothing to move (an empty buffer the pool need not track)
        flat = torch.empty(layout.total, dtype=torch.uint8, device=device)
    return _views(flat, specs, layout), (flat[:layout.total] if layout.total else None)


def payload_buffer(tensors: list[torch.Tensor], layout: PayloadLayout) -> torch.Tensor | None:
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


# ---------------------------------------------------------------- buffers


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
        self._released: dict[int, Any] = {}  # CUDA: data_ptr -> event recorded at release (see `release`)
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
            released = self._released.pop(buf.data_ptr(), None)
            if released is not None:  # the last user's kernels come first (see `release`)
                torch.cuda.current_stream(self.device).wait_event(released)
            self._leased[buf.data_ptr()] = buf
            return buf

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        """Give back the buffer under a batch's tensors; the tensors must not be used afterwards.

        On CUDA the releasing thread's stream (training) may still have kernels reading the buffer: an
        event recorded here is waited for by whichever stream takes the buffer next (the receiver's side
        stream, which the receive's NCCL stream follows), and `record_stream` keeps the allocator from
        handing the memory out early if the pool drops the buffer.
        """
        cuda = self.device.type == "cuda"
        with self._lock:
            for ptr in {t.untyped_storage().data_ptr() for t in tensors.values()}:
                buf = self._leased.pop(ptr, None)
                if buf is not None:
                    if cuda:
                        stream = torch.cuda.current_stream(self.device)
                        buf.record_stream(stream)
                        self._released[buf.data_ptr()] = stream.record_event()
                    self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self.max_free:]  # keep the largest few
            kept = {b.data_ptr() for b in self._free}
            self._released = {ptr: ev for ptr, ev in self._released.items() if ptr in kept}

    def tensors(self, specs: list[Spec]) -> dict[str, torch.Tensor]:
        """Empty tensors for `specs`, all views of one pooled buffer laid out as the payload."""
        return packed_empty(specs, self.device, self)


def describe_specs(specs: list[Spec]) -> str:
    """Specs for an error message: "input_ids int64[2, 3], context bfloat16[2, 3, 640]"."""
    return ", ".join(f"{name} {str(dtype).removeprefix('torch.')}{list(shape)}" for name, dtype, shape in specs)
