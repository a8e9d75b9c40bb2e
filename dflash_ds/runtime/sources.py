"""Where a drafter's batches come from: over the bridge from target ranks, or from the target on its own rank.

Both sources walk the same batch stream (`BatchStream.micro_steps`: drafter d's batch of micro-step u
is global batch u·D + d) and hand the drafter loop the same thing, a `SourcedBatch`: the tensors a
target computes (`capture_batch`: input_ids, loss_mask, lengths, context[, last_hidden]) and the
header meta (`wire.batch_meta`). Same seed, same batches, same losses and checkpoints for
1..T targets + D drafters and for D colocated ranks.

Colocated (topology.colocate), memory on the shared device (per rank): the target's weights in
the run's dtype, in eval mode and without gradients (Qwen3-8B in bf16: 8.2 B x 2 B = 16.4 GB);
its forward runs under no_grad, so its activations are freed layer by layer as it goes and only
the captured layers survive it (K x H x tokens x 2 B: 5 x 4096 x 16,384 x 2 = 0.67 GB at a
16k-token batch, the same buffer the bridge would have received), no vocabulary logits (the body
runs, not the head). The drafter's frozen embedding and LM head are the target's own tensors, not
a second copy (2 x 1.24 GB saved for an untied Qwen3-8B; `engine.frozen_head`). See
docs/MEMORY.md "Colocated training".

With `overlap` (topology.colocate_overlap) a thread computes the next batch's target forward
while the drafter step runs, on a CUDA stream of its own on GPU: it keeps one more batch of
captured states alive and needs idle compute to gain anything (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from typing import Callable, NamedTuple, Protocol

import torch

from dflash_ds.config import Config
from dflash_ds.data.batching import BatchSpec, Cursor
from dflash_ds.data.loader import Batch, PrefetchLoader
from dflash_ds.data.stream import BatchStream
from dflash_ds.distributed import bridge as bridge_mod
from dflash_ds.distributed.payload import BufferPool
from dflash_ds.distributed.topology import RoleContext
from dflash_ds.distributed.wire import batch_meta, payload_specs
from dflash_ds.models.target import capture_layers
from dflash_ds.runtime.feature_cache import FeatureCache, open_feature_cache


class SourcedBatch(NamedTuple):
    """One batch for the drafter step."""

    batch_id: int  # global batch id
    tensors: dict[str, torch.Tensor]  # input_ids, loss_mask, lengths, context[, last_hidden]
    meta: dict  # the header meta (wire.batch_meta)
    depth: int  # batches already waiting when this one was taken (logged as hs_queue_depth)


class BatchSource(Protocol):
    """This drafter's batches, in the order of the batch stream."""

    def get(self) -> SourcedBatch:
        """The next batch."""

    def release(self, tensors: dict) -> None:
        """The step is done with these tensors."""

    def close(self) -> None:
        """Stop whatever runs in the background."""


# place(input_ids, loss_mask, lengths, layers, last_hidden or None) -> the payload dict
Placer = Callable[..., dict]


def fresh_payload(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, layers: list,
                  last_hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The payload in new tensors on the ids' device (the selected layers concatenated into a fresh one)."""
    dev = input_ids.device
    out = {"input_ids": input_ids, "loss_mask": loss_mask.to(dev, non_blocking=True),
           "lengths": lengths.to(dev, non_blocking=True),
           "context": torch.cat(layers, dim=-1)}
    if last_hidden is not None:
        out["last_hidden"] = last_hidden
    return out


def capture_batch(target: torch.nn.Module, batch: Batch, layer_ids: list[int], keep_last: bool,
                  device: torch.device, place: Placer = fresh_payload) -> dict[str, torch.Tensor]:
    """Target forward + capture of one loaded batch: the payload dict a drafter trains on.

    The selected layers' outputs (hooks, `capture_layers`) and the final hidden when the loss has
    a KL term. `place` puts them where the caller wants them: a target rank passes
    `wire.build_payload` with its sender, which concatenates the layers straight into a pooled send
    buffer (no further copy); the default makes fresh tensors (colocated ranks, bench).
    """
    # Asynchronous from the loader's pinned tensors on CUDA (a no-op on CPU): no host stall per batch.
    ids = batch.input_ids.to(device, non_blocking=True)
    layers, last = capture_layers(target, ids, batch.attention_mask.to(device, non_blocking=True), layer_ids)
    # The target's own activations are gone with its forward (no_grad): only the captured ones remain.
    return place(ids, batch.loss_mask, batch.lengths, layers, last if keep_last else None)


class BridgeSource:
    """Background thread receiving this drafter's batches in step order from the routed targets.

    `specs_of(BatchSpec)` gives each batch's payload specs from the shared batch stream
    (`wire.payload_specs`), so the receives of the next `depth` batches are posted before the
    targets have produced them.
    """

    def __init__(self, ctx: RoleContext, data: BatchStream, start_step: int, cursor: Cursor, stop_step: int,
                 specs_of: Callable[[BatchSpec], list], depth: int = 2) -> None:
        self.ctx, self.depth, self.q = ctx, depth, queue.Queue(maxsize=depth)
        # Reused receive buffers: fresh multi-MiB tensors per batch page-fault on every first touch.
        # At most 2 * depth + 2 batches leased at once (posted, queued, waiting, in the step) and 2 kept free:
        # the arithmetic of memory/model.PAYLOADS_ALIVE and docs/MEMORY.md.
        self.pool = BufferPool(ctx.device, max_free=2)
        self.receiver: bridge_mod.Receiver | None = None
        layout, d = ctx.layout, ctx.data_rank  # under sequence parallelism: its group's batches (their shards)
        # The same walk over the batch stream as the targets' (target_worker.my_batches).
        schedule = ((ms.batch_id(d), layout.target_rank_for(ms.index, d), specs_of(ms.specs[d]))
                    for ms in data.micro_steps(start_step, cursor, stop_step))
        self.thread = threading.Thread(target=self._work, args=(schedule,), daemon=True, name="drafter-receiver")
        self.thread.start()

    def _work(self, schedule) -> None:
        # On CUDA this thread posts receives and reads headers on a stream of its own: nothing it does
        # waits behind the training kernels or holds them (completion is polled: bridge._poll).
        side = contextlib.nullcontext()
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # the current device is per thread
            side = torch.cuda.stream(torch.cuda.Stream(self.ctx.device))
        try:
            with side:
                self.receiver = bridge_mod.Receiver(self.ctx.bridge, schedule, depth=self.depth,
                                                    timeout_s=self.ctx.bridge_timeout_s, device=self.ctx.device,
                                                    pool=self.pool)
                for got in self.receiver:
                    self.q.put(got)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop
            self.q.put(exc)

    def get(self) -> SourcedBatch:
        """Next batch; its depth is how many were already waiting (the queue depth the step saw)."""
        depth = self.q.qsize()
        try:
            item = self.q.get(timeout=self.ctx.bridge_timeout_s * 2)
        except queue.Empty:
            raise TimeoutError(f"no batch from any target within {self.ctx.bridge_timeout_s * 2:.0f}s") from None
        if isinstance(item, BaseException):
            raise item
        return SourcedBatch(*item, depth)

    def release(self, tensors: dict) -> None:
        """The step is done with this batch: its buffer may receive a later one."""
        self.pool.release(tensors)

    def close(self) -> None:
        """Teardown after the last step, in this order: stop posting and abort the bridge in one step if
        receives are still posted (past the stop step: no target will ever send them, and a group shut down
        would wait on them), then join the thread. The role groups are destroyed after this (topology.shutdown),
        which leaves an aborted bridge alone."""
        receiver = self.receiver
        if receiver is not None:
            receiver.close(abort=self._abort_bridge)
        deadline = time.monotonic() + 2.0  # a polling (CUDA) wait ends at once; a gloo wait cannot be cut short
        while self.thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self.q.get_nowait()  # a thread blocked handing over a batch (queue full) goes on
            self.thread.join(0.05)

    def _abort_bridge(self) -> None:
        self.ctx.bridge.abort()
        self.ctx.bridge = None  # aborted: topology.shutdown has nothing left to end on it


class LocalTargetSource:
    """This rank's batches in step order, each with the target's states computed here (colocated)."""

    def __init__(self, ctx: RoleContext, target: torch.nn.Module, data: BatchStream, start_step: int, cursor: Cursor,
                 stop_step: int, layer_ids: list[int], last_hidden: bool, prefetch: int = 2,
                 overlap: bool = False, cache: FeatureCache | None = None) -> None:
        self.ctx, self.target, self.layer_ids, self.last_hidden = ctx, target, list(layer_ids), last_hidden
        self.cache, self.cache_hits = cache, 0
        d = ctx.data_rank  # under sequence parallelism every rank of a group computes its group's batch
        self._ids: deque[int] = deque()

        def mine():
            for ms in data.micro_steps(start_step, cursor, stop_step):
                self._ids.append(ms.batch_id(d))  # appended before its batch is queued: popped in the same order
                yield ms.after, ms.specs[d]

        self.loader = PrefetchLoader(data.dataset, mine(), depth=prefetch, pin_memory=ctx.device.type == "cuda")
        self._batches = iter(self.loader)
        self.served, self.t_start = 0, time.perf_counter()
        self._stream = torch.cuda.Stream(device=ctx.device) if overlap and ctx.device.type == "cuda" else None
        self._q: queue.Queue | None = None
        if overlap:
            self._q = queue.Queue(maxsize=1)  # one batch ahead: the one computed during the current step
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._work, daemon=True, name="colocated-target")
            self._thread.start()

    def _compute(self) -> tuple[int, dict, dict] | None:
        """The next batch's (global batch id, tensors, meta) (None at the end of the run)."""
        batch = next(self._batches, None)
        if batch is None:
            return None
        batch_id, dev = self._ids.popleft(), self.ctx.device
        t0 = time.perf_counter()
        tensors = self._features(batch, dev)
        if dev.type == "cuda" and self._stream is None:
            torch.cuda.current_stream(dev).synchronize()  # a forward time, not a launch time
        fwd = time.perf_counter() - t0
        self.served += 1
        rate = self.served / max(time.perf_counter() - self.t_start, 1e-9)
        return batch_id, tensors, batch_meta(batch.spec, batch.cursor, fwd, rate, 0, self.ctx.global_rank)

    def _features(self, batch: Batch, dev: torch.device) -> dict[str, torch.Tensor]:
        """The batch's payload: read from the feature cache when every row is there, else the target's forward
        (then written to the cache, in the bound, when it is on)."""
        cache, rows = self.cache, batch.spec.sample_ids
        if cache is None:
            return capture_batch(self.target, batch, self.layer_ids, self.last_hidden, dev)
        dtype = self.target.dtype
        if cache.has(rows):
            context, last = cache.read(rows, batch.input_ids.shape[1])
            if self.cache_hits == 0 and self.ctx.global_rank == 0:
                print(f"[dflash-ds] feature cache: batches whose rows are all cached are read from "
                      f"{cache.folder} from here on (from this rank's batch {self.served + 1}), not computed", flush=True)
            self.cache_hits += 1
            ids = batch.input_ids.to(dev, non_blocking=True)
            return fresh_payload(ids, batch.loss_mask, batch.lengths, [context.to(dev, dtype)],
                                 last.to(dev, dtype) if self.last_hidden and last is not None else None)
        tensors = capture_batch(self.target, batch, self.layer_ids, self.last_hidden, dev)
        cache.store(rows, tensors["context"], tensors.get("last_hidden"))
        return tensors

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

    def get(self) -> SourcedBatch:
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
            raise RuntimeError("colocated rank: the batch stream ran out of batches before the last step")
        return SourcedBatch(*item, depth)

    def release(self, tensors: dict) -> None:
        """Nothing is pooled: the batch's tensors are freed when the step drops them."""

    def close(self) -> None:
        """Stop the overlap thread (if any) and the loader."""
        if self._q is not None:
            self._stop.set()
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
        self.loader.close()
        if self.cache is not None:
            if self._q is not None:
                self._thread.join(timeout=self.ctx.timeout_s)  # it may be writing a batch to the cache
            self.cache.close()


def open_source(ctx: RoleContext, cfg: Config, arch, dtype: torch.dtype, data: BatchStream, start_step: int,
                cursor: Cursor, stop_step: int, target: torch.nn.Module | None = None) -> BatchSource:
    """The colocated rank's own target if it loaded one, else the bridge from the target ranks."""
    kl = cfg.loss.needs_last_hidden  # KL, LK or target labels: carry the final hidden state
    if target is not None:
        cache, why = open_feature_cache(cfg, arch, dtype, data, ctx.global_rank, ctx.device)
        if ctx.global_rank == 0:
            print(f"[dflash-ds] feature cache: {why}", flush=True)
        return LocalTargetSource(ctx, target, data, start_step, cursor, stop_step, arch.target_layer_ids, kl,
                                 prefetch=cfg.data.prefetch, overlap=cfg.topology.colocate_overlap, cache=cache)
    n = ctx.layout.sequence_parallel
    return BridgeSource(ctx, data, start_step, cursor, stop_step,
                        lambda spec: payload_specs(spec, arch, dtype, kl, n), depth=2)
