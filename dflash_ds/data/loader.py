"""Background prefetcher: turns batch specs into padded tensors ahead of the trainer.

The dataset is the Arrow folder written by `prepare` (`save_to_disk`), with
columns `input_ids`, `loss_mask` (lists of ints) and `length`. It stays
memory-mapped: each batch reads only its own rows.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_ds.data.batching import BatchSpec, Cursor
from dflash_ds.errors import DFlashError

COLUMNS = ("input_ids", "loss_mask", "length")


@dataclass
class Batch:
    """Right-padded tensors of one batch plus where it came from."""

    input_ids: torch.Tensor  # [n, Lmax] long, padded with pad_id
    loss_mask: torch.Tensor  # [n, Lmax] long, 0 on padding
    attention_mask: torch.Tensor  # [n, Lmax] long, 1 on real tokens
    lengths: torch.Tensor  # [n] long
    spec: BatchSpec
    cursor: Cursor  # position after this batch: checkpoint it to resume after this step


def _check_columns(dataset: Any) -> None:
    missing = [c for c in COLUMNS if c not in dataset.column_names]
    if missing:
        raise DFlashError(f"dataset lacks column(s) {missing}; expected {list(COLUMNS)} (run `dflash-ds prepare`)")


def load_lengths(dataset: Any) -> np.ndarray:
    """The `length` column as an int64 array (the only column read in full)."""
    _check_columns(dataset)
    return np.asarray(dataset.with_format("numpy")["length"], dtype=np.int64)


def collate(rows: dict[str, list], spec: BatchSpec, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-pad the rows of one batch into (input_ids, loss_mask, attention_mask, lengths)."""
    n, width = spec.num_seqs, spec.max_length
    input_ids = np.full((n, width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((n, width), dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for k, (sample, ids, mask, length) in enumerate(
        zip(spec.sample_ids, rows["input_ids"], rows["loss_mask"], rows["length"])
    ):
        # The sampler trusted `length` to respect the token budget: a mismatch
        # means the dataset is corrupt, not something to pad around.
        if not len(ids) == len(mask) == length or length > width:
            raise DFlashError(
                f"sample {sample}: input_ids has {len(ids)} tokens, loss_mask {len(mask)}, length column {length}"
            )
        input_ids[k, :length] = ids
        loss_mask[k, :length] = mask
        lengths[k] = length
    attention_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    return tuple(torch.from_numpy(a) for a in (input_ids, loss_mask, attention_mask, lengths))


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class PrefetchLoader:
    """Iterator of `Batch`es built by a background thread, `depth` batches ahead."""

    def __init__(
        self,
        dataset: Any,
        batches: Iterable[tuple[Cursor, BatchSpec]],
        pad_id: int = 0,
        depth: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if depth < 1:
            raise DFlashError(f"prefetch depth must be >= 1, got {depth}")
        _check_columns(dataset)
        # Dropping other columns is free (no copy) and keeps each row read small.
        self._dataset = dataset.select_columns(list(COLUMNS)).with_format(None)
        self._batches = iter(batches)
        self._pad_id = pad_id
        # Page-locked host tensors (CUDA runs): their copies to the device are asynchronous
        # (`non_blocking=True`), so feeding the target never stalls the host on a pageable copy.
        self._pin = pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name="dflash-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        # Poll so that close() can stop a producer blocked on a full queue.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for cursor, spec in self._batches:
                if self._stop.is_set():
                    return
                rows = self._dataset[spec.sample_ids]
                input_ids, loss_mask, attention_mask, lengths = collate(rows, spec, self._pad_id)
                if self._pin:
                    input_ids, loss_mask, attention_mask, lengths = (
                        t.pin_memory() for t in (input_ids, loss_mask, attention_mask, lengths))
                if not self._put(Batch(input_ids, loss_mask, attention_mask, lengths, spec, cursor)):
                    return
        except BaseException as exc:  # noqa: BLE001 (re-raised in the consumer thread)
            self._put(_Failure(exc))
            return
        self._put(_END)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        while not self._done:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True  # stopped by close()
                continue
            if item is _END:
                self._done = True
            elif isinstance(item, _Failure):
                self._done = True
                raise item.exc
            else:
                return item
        raise StopIteration

    def close(self) -> None:
        """Stop the background thread and drop the batches it prefetched."""
        self._stop.set()
        self._done = True
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)

    @property
    def alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
