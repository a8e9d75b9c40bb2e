"""Colocated training (topology.colocate): every rank runs the frozen target on its own batches.

A colocated rank is a drafter rank whose batches do not come over the bridge: `LocalTargets`
walks the same data plan as the disaggregated receiver (`BatchStream.micro_steps`: drafter d's
batch of micro-step u is global batch u·D + d), runs the target forward with the layer hooks of
`capture_layers` on this rank's device and hands the drafter loop the very tensors a target rank
would have sent (input_ids, loss_mask, lengths, context[, last_hidden]) and the same header
meta. Same seed, same batches, same losses and checkpoints as 1..T targets + D drafters.

Memory on the shared device (per rank): the target's weights in the run's dtype, in eval mode
and without gradients (Qwen3-8B in bf16: 8.2 B x 2 B = 16.4 GB); its forward runs under
no_grad, so its activations are freed layer by layer as it goes and only the captured layers
survive it (K x H x tokens x 2 B: 5 x 4096 x 16,384 x 2 = 0.67 GB at a 16k-token batch, the
same buffer the bridge would have received), no vocabulary logits (the body runs, not the
head). The drafter's frozen embedding and LM head are the target's own tensors, not a second
copy (2 x 1.24 GB saved for an untied Qwen3-8B). See docs/MEMORY.md "Colocated training".

With `overlap` (topology.colocate_overlap) a thread computes the next batch's target forward
while the drafter step runs, on a CUDA stream of its own on GPU: it keeps one more batch of
captured states alive and needs idle compute to gain anything (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from dflash_ds.data.batching import Cursor
from dflash_ds.data.loader import PrefetchLoader
from dflash_ds.data.stream import BatchStream
from dflash_ds.distributed.wire import batch_meta
from dflash_ds.models.target import capture_layers, target_parts


class LocalTargets:
    """This rank's batches in step order, each with the target's states computed here.

    The same interface as the drafter's bridge `Receiver`: `get()` -> (global batch id, tensors,
    meta, queue depth), `release(tensors)`, `close()`.
    """

    def __init__(self, ctx, target: torch.nn.Module, data: BatchStream, start_step: int, cursor: Cursor,
                 stop_step: int, layer_ids: list[int], last_hidden: bool, prefetch: int = 2,
                 overlap: bool = False) -> None:
        self.ctx, self.target, self.layer_ids, self.last_hidden = ctx, target, list(layer_ids), last_hidden
        d = ctx.role_rank
        self._ids: deque[int] = deque()

        def mine():
            for ms in data.micro_steps(start_step, cursor, stop_step):
                self._ids.append(ms.batch_id(d))  # appended before its batch is queued: popped in the same order
                yield ms.after, ms.specs[d]

        self.loader = PrefetchLoader(data.dataset, mine(), depth=prefetch)
        self._batches = iter(self.loader)
        self.served, self.t_start = 0, time.perf_counter()
        self.overlap = overlap
        self._stream = torch.cuda.Stream(device=ctx.device) if overlap and ctx.device.type == "cuda" else None
        self._q: queue.Queue | None = None
        if overlap:
            self._q = queue.Queue(maxsize=1)  # one batch ahead: the one computed during the current step
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True, name="colocated-target")
            self._thread.start()

    def _compute(self):
        """The next batch's states (None at the end of the run)."""
        batch = next(self._batches, None)
        if batch is None:
            return None
        batch_id = self._ids.popleft()
        spec, after, dev = batch.spec, batch.cursor, self.ctx.device
        t0 = time.perf_counter()
        ids = batch.input_ids.to(dev)
        layers, last = capture_layers(self.target, ids, batch.attention_mask.to(dev), self.layer_ids)
        tensors = {"input_ids": ids, "loss_mask": batch.loss_mask.to(dev), "lengths": batch.lengths.to(dev),
                   "context": torch.cat(layers, dim=-1)}
        del layers  # the target's own activations are gone with its forward (no_grad): only these remain
        if self.last_hidden:
            tensors["last_hidden"] = last
        del last
        if dev.type == "cuda" and self._stream is None:
            torch.cuda.current_stream(dev).synchronize()  # a forward time, not a launch time
        fwd = time.perf_counter() - t0
        self.served += 1
        rate = self.served / max(time.perf_counter() - self.t_start, 1e-9)
        return batch_id, tensors, batch_meta(spec, after, fwd, rate, 0, self.ctx.global_rank)

    def _work(self) -> None:
        assert self._q is not None
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # the current device is per thread
        try:
            while not self._stop.is_set():
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        item = self._compute()
                        event = torch.cuda.Event()
                        event.record(self._stream)
                else:
                    item, event = self._compute(), None
                self._q.put((item, event))
                if item is None:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop
            self._q.put((exc, None))

    def get(self) -> tuple[int, dict, dict, int]:
        """Next batch, its states computed on this rank; the depth is how many were ready (0 or 1)."""
        if self._q is None:
            item, depth = self._compute(), 0
        else:
            depth = self._q.qsize()
            item, event = self._q.get(timeout=self.ctx.timeout_s * 2)
            if isinstance(item, BaseException):
                raise item
            if event is not None and item is not None:
                # The drafter step reads tensors made on the side stream: order it after them, and
                # tell the allocator they are used on this stream too.
                current = torch.cuda.current_stream(self.ctx.device)
                current.wait_event(event)
                for t in item[1].values():
                    t.record_stream(current)
        if item is None:
            raise RuntimeError("colocated rank: the data plan ran out of batches before the last step")
        return (*item, depth)

    def release(self, tensors: dict) -> None:
        """Nothing is pooled: the batch's tensors are freed when the step drops them."""

    def close(self) -> None:
        if self._q is not None:
            self._stop.set()
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
        self.loader.close()


def frozen_head(target: torch.nn.Module):
    """The target's embedding and LM head modules: the drafter shares their tensors (no second copy)."""
    parts = target_parts(target)
    return parts.embed, parts.head


def check_shared_head(engine, target: torch.nn.Module) -> str | None:
    """A warning if the engine's frozen embedding / head are not the target's own tensors (a copy costs V x H x
    dtype bytes each: 1.24 GB per matrix for Qwen3-8B in bf16), else None."""
    parts, module = target_parts(target), engine.module
    pairs = [(module.embed_weight, parts.embed.weight)]
    if not module.tied_head:
        pairs.append((module.head_weight, parts.head.weight))
    copied = [mine for mine, theirs in pairs if mine.data_ptr() != theirs.data_ptr()]
    if not copied:
        return None
    gb = sum(t.numel() * t.element_size() for t in copied) / 1e9
    return (f"the DeepSpeed engine holds its own copy of the target's embedding/LM head ({gb:.2f} GB more on "
            f"every rank than colocated training needs); is the target loaded in the run's dtype?")
