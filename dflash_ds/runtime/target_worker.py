"""Target ranks: frozen target forward, capture of the selected layers, asynchronous send to drafters.

A loader thread keeps the next batches read and padded; the main thread runs the target and
builds each batch's payload in a pooled send buffer (the selected layers are concatenated
straight into it) and posts its send (header + payload) without waiting, so batch i+1 is
computed while batch i is on the wire (the sender keeps at most `depth` batches in flight).

A sharded target (topology.target_parallel k > 1): the k ranks of a replica walk the same batches (those
routed to the replica), run every forward together (transformers' tensor parallelism all-reduces inside
it, so each gets the whole hidden states), and only the replica's first rank sends: the drafters see one
target per replica, as with k = 1.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import replace
from typing import Iterator

import torch

from dflash_ds.config import Config
from dflash_ds.data.batching import BatchSpec, Cursor
from dflash_ds.data.loader import PrefetchLoader
from dflash_ds.data.stream import BatchStream
from dflash_ds.distributed import bridge as bridge_mod
from dflash_ds.distributed.topology import RoleContext
from dflash_ds.distributed.wire import batch_meta, build_payload, payload_specs, receive_start
from dflash_ds.models.drafter_arch import DrafterArch
from dflash_ds.process_exit import say
from dflash_ds.runtime import faults
from dflash_ds.runtime.job import last_step, load_run_target
from dflash_ds.runtime.sources import capture_batch
from dflash_ds.runtime.watchdog import (EXIT_PREEMPTED, STOP_SAVED_KEY, STOP_STEP_KEY, Watchdog, decide_exit,
                                        hard_exit)


def run_target(ctx: RoleContext, cfg: Config, data: BatchStream, watchdog: Watchdog, arch: DrafterArch,
               dtype: torch.dtype) -> int:
    """Serve every batch routed to this target until the last step (or the drafters' stop step)."""
    layout = ctx.layout
    target = load_run_target(cfg, dtype, ctx.device, ctx.global_rank)
    start_step, cursor, global_batch = receive_start(ctx, layout.drafter_ranks[0], cfg.train.startup_timeout_s)
    # The leader's word is final (this rank may not see the checkpoint folder it resumed from). A new
    # stream, whose __post_init__ checks that G splits over the drafters; the caller's is left as it is.
    data = replace(data, global_batch=global_batch)
    kl = cfg.loss.needs_last_hidden  # KL, LK or target labels: send the final hidden state
    watchdog.tick_hooks.append(functools.partial(_exit_once_drafters_stopped, ctx, watchdog))
    n = layout.sequence_parallel  # > 1: each rank of a drafter group is sent its shard of every batch
    sender = bridge_mod.AsyncSender(ctx.bridge, depth=2 * n, timeout_s=ctx.bridge_timeout_s, device=ctx.device)
    sends = ctx.replica_rank == 0  # a replica's other ranks compute with it and send nothing
    served, t_start = 0, time.perf_counter()
    routed: deque[tuple[int, int]] = deque()  # (step, global batch id) of each batch the loader was handed
    loader = PrefetchLoader(data.dataset, _my_batches(ctx, data, start_step, cursor, last_step(cfg), routed),
                            depth=cfg.data.prefetch, pin_memory=ctx.device.type == "cuda")
    stopped = False
    for batch in loader:
        step, batch_id = routed.popleft()
        watchdog.step = step
        faults.at_step(step, stop_step_agreed=lambda: _stop_step(ctx, watchdog) is not None)
        # Keep serving after a stop request: the drafters need this step's batches to reach the step
        # at which they all agree to stop; only what lies past that step is dropped.
        if _past_stop(ctx, watchdog, step):
            stopped = True
            break
        t0 = time.perf_counter()
        if not sends:
            capture_batch(target, batch, arch.target_layer_ids, kl, ctx.device, place=_discard)
            continue
        into_send_buffers = functools.partial(_build_parts, sender, payload_specs(batch.spec, arch, dtype, kl, n), n)
        parts = capture_batch(target, batch, arch.target_layer_ids, kl, ctx.device, place=into_send_buffers)
        fwd = time.perf_counter() - t0
        served += 1
        meta = batch_meta(batch.spec, batch.cursor, fwd, served / max(time.perf_counter() - t_start, 1e-9),
                          sender.in_flight(), ctx.global_rank)
        for rank, tensors in zip(layout.drafter_ranks_for(batch_id), parts):
            sender.send(rank, tensors, meta, batch_id=batch_id)
    loader.close()
    if stopped:
        # Batches still in flight belong to steps nobody will train: no drafter posts their receives, so the
        # group is aborted now (shutting it down would wait on them, with this rank's watchdog already closed).
        if sender.abort():
            ctx.bridge = None  # aborted: topology.shutdown has nothing left to end on it
        return _await_stop_checkpoint(watchdog)
    sender.flush()
    # Every batch served. A short run's targets get here before the drafters finish: wait for their verdict, so
    # that a run they stopped early (a SIGTERM anywhere, after this rank's last batch) ends 75 here too, as on
    # every other rank. Rank 0 waits for every rank at shutdown anyway.
    deadline = time.monotonic() + ctx.timeout_s
    drafters_done = [f"dflash/done/{r}" for r in layout.drafter_ranks]
    while time.monotonic() < deadline and not watchdog.store.check(drafters_done):
        if watchdog.store.check([STOP_STEP_KEY]):
            return _await_stop_checkpoint(watchdog)
        time.sleep(0.1)
    return _await_stop_checkpoint(watchdog) if watchdog.store.check([STOP_STEP_KEY]) else 0


def _await_stop_checkpoint(watchdog: Watchdog) -> int:
    """75, once the drafters' leader says the stop checkpoint is committed (on every host: `latest` names it).

    Not sooner: a rank's exit is what its host's launcher acts on. DeepSpeed's launch.py (torchrun likewise) SIGTERMs
    the host's other ranks once one exits non-zero and SIGKILLs them 30 s later, so a target leaving at the stop
    step cut a longer save short on the drafters beside it, while the job still ended 75 (pdsh -S reports the
    largest status). A drafter that dies meanwhile ends this rank through the watchdog (3), never with 75.
    """
    while not watchdog.store.check([STOP_SAVED_KEY]):
        time.sleep(0.1)
    return EXIT_PREEMPTED


def _my_batches(ctx: RoleContext, data: BatchStream, start_step: int, cursor: Cursor, stop_step: int,
                routed: deque) -> Iterator[tuple[Cursor, BatchSpec]]:
    """(cursor after, spec) of each batch routed to this target, in order, for the loader thread.

    Each one's (step, global batch id) goes into `routed` first: the main thread pops them in the same order.
    """
    layout = ctx.layout
    t_idx = ctx.role_rank if ctx.replica is None else ctx.replica  # which target of the router this rank serves
    for ms in data.micro_steps(start_step, cursor, stop_step):
        for d, spec in enumerate(ms.specs):
            if layout.route(ms.index, d) == t_idx:
                routed.append((ms.step, ms.batch_id(d)))
                yield ms.after, spec


def _build_parts(sender: bridge_mod.AsyncSender, planned: list, shards: int, *captured) -> list[dict]:
    """The payload of each of the `shards` ranks of a batch's drafter group, in their order (one without sequence
    parallelism), each in a pooled send buffer (`wire.build_payload`)."""
    return [build_payload(sender, planned, *captured, part=(i, shards)) for i in range(shards)]


def _discard(*_payload) -> None:
    """A replica's non-sending rank: the hidden states it computed are its leader's to send."""


def _stop_step(ctx: RoleContext, watchdog: Watchdog) -> int | None:
    """The step the drafters agreed to stop at, once the leader has published it (preemption), else None."""
    # The watchdog's own store client: this also runs on the watchdog thread (never behind a blocked call).
    if watchdog.stop_event.is_set() and watchdog.store.check([STOP_STEP_KEY]):
        return int(watchdog.store.get(STOP_STEP_KEY))
    return None


def _past_stop(ctx: RoleContext, watchdog: Watchdog, step: int) -> bool:
    """Whether a batch of step `step` lies at or after the agreed stop step (no drafter will take it).

    The step comes from the stream's walk: a validation batch's id (negative) names no step.
    """
    s = _stop_step(ctx, watchdog)
    return s is not None and step >= s


def _exit_once_drafters_stopped(ctx: RoleContext, watchdog: Watchdog) -> None:
    """Leave from the watchdog thread once every drafter has checkpointed and finished (a target holds no state).

    This rank may be blocked sending a batch no drafter will take.
    """
    s = _stop_step(ctx, watchdog)
    if s is not None and all(watchdog.store.check([f"dflash/done/{r}"]) for r in ctx.layout.drafter_ranks):
        # What the others and the launcher read first, the line last: a write to a stalled stdout pipe must not
        # hold this thread (its heartbeat) until rank 0 calls the rank lost and the guard ends it with 3.
        watchdog.mark_done()  # rank 0, still waiting for the others to check out, must not call it lost
        watchdog.store.add("dflash/shutdown", 1)
        decide_exit(EXIT_PREEMPTED)
        say(f"[dflash-ds] target rank {ctx.global_rank}: drafters stopped at step {s}; exiting with "
            f"status {EXIT_PREEMPTED}")
        hard_exit(EXIT_PREEMPTED)
