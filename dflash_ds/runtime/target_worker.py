"""Target ranks: frozen target forward, capture of the selected layers, asynchronous send to drafters.

A loader thread keeps the next batches read and padded; the main thread runs the target and
builds each batch's payload in a pooled send buffer (the selected layers are concatenated
straight into it) and posts its send (header + payload) without waiting, so batch i+1 is
computed while batch i is on the wire (the sender keeps at most `depth` batches in flight).
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from dflash_ds.config import Config
from dflash_ds.data.batching import Cursor
from dflash_ds.data.loader import PrefetchLoader
from dflash_ds.distributed import bridge as bridge_mod
from dflash_ds.distributed.topology import RoleContext
from dflash_ds.errors import DFlashError
from dflash_ds.models.target import capture_layers, load_target
from dflash_ds.runtime import faults
from dflash_ds.runtime.watchdog import EXIT_PREEMPTED, STOP_STEP_KEY, Watchdog
from dflash_ds.data.stream import BatchStream, check_global_batch
from dflash_ds.runtime.job import last_step, resolve_arch, torch_dtype
from dflash_ds.distributed.wire import batch_meta, build_payload, payload_specs, receive_start



def run_target(ctx: RoleContext, cfg: Config, data: BatchStream, watchdog: Watchdog) -> int:
    """Serve every batch routed to this target until the last step (or the drafters' stop step)."""
    layout = ctx.layout
    t_idx, n_d = ctx.role_rank, layout.num_drafters
    arch = resolve_arch(cfg)
    dtype = torch_dtype(cfg, ctx.device.type == "cuda")
    target = load_target(cfg.target, dtype=dtype, device=ctx.device)
    start_step, cursor, global_batch = receive_start(ctx, layout.drafter_ranks[0], cfg.train.startup_timeout_s)
    # The leader's word is final (this rank may not see the checkpoint folder it resumed from).
    check_global_batch(global_batch, n_d)
    data.global_batch = global_batch
    send_last_hidden = cfg.loss.kl_weight > 0

    # (step, global batch id) of each batch handed to the loader thread, consumed in the same order.
    routed: deque[tuple[int, int]] = deque()

    def my_batches():
        for ms in data.micro_steps(start_step, cursor, last_step(cfg)):
            for d, spec in enumerate(ms.specs):
                if layout.route(ms.index, d) == t_idx:
                    routed.append((ms.step, ms.batch_id(d)))
                    yield ms.after, spec

    def stop_step() -> int | None:
        # Set by the leader once the drafters agreed to stop (preemption): later batches are never taken.
        if watchdog.stop_event.is_set() and ctx.store.check([STOP_STEP_KEY]):
            return int(ctx.store.get(STOP_STEP_KEY))
        return None

    def abandon(batch_id: int) -> bool:
        s = stop_step()
        return s is not None and data.step_of_batch(batch_id) >= s

    def exit_once_drafters_stopped() -> None:
        # This rank may be blocked sending a batch no drafter will take: once every drafter has
        # checkpointed and finished, leave from the watchdog thread (a target holds no state).
        if stop_step() is not None and all(ctx.store.check([f"dflash/done/{r}"]) for r in layout.drafter_ranks):
            print(f"[dflash-ds] target rank {ctx.global_rank}: drafters stopped at step {stop_step()}; exiting with "
                  f"status {EXIT_PREEMPTED}", flush=True)
            ctx.store.add("dflash/shutdown", 1)
            os._exit(EXIT_PREEMPTED)

    watchdog.tick_hooks.append(exit_once_drafters_stopped)
    sender = bridge_mod.AsyncSender(ctx.bridge, depth=2, timeout_s=ctx.timeout_s, device=ctx.device)
    served, t_start = 0, time.perf_counter()
    loader = PrefetchLoader(data.dataset, my_batches(), depth=cfg.data.prefetch)
    stopped = False
    for batch in loader:
        step, batch_id = routed.popleft()
        watchdog.step = step
        faults.at_step(step)
        # Keep serving after a stop request: the drafters need this step's batches to reach the step
        # at which they all agree to stop; only what lies past that step is dropped.
        if abandon(batch_id):
            stopped = True
            break
        spec, after = batch.spec, batch.cursor
        t0 = time.perf_counter()
        ids = batch.input_ids.to(ctx.device)
        layers, last = capture_layers(target, ids, batch.attention_mask.to(ctx.device), arch.target_layer_ids)
        planned = payload_specs(spec, arch, dtype, send_last_hidden)
        tensors = build_payload(sender, planned, ids, batch.loss_mask, batch.lengths, layers,
                                last if send_last_hidden else None)
        fwd = time.perf_counter() - t0
        served += 1
        meta = batch_meta(spec, after, fwd, served / max(time.perf_counter() - t_start, 1e-9), sender.in_flight(),
                          ctx.global_rank)
        sender.send(layout.drafter_ranks[batch_id % n_d], tensors, meta, batch_id=batch_id)
    loader.close()
    if stopped:
        return EXIT_PREEMPTED  # batches still in flight belong to steps nobody will train
    sender.flush()
    return 0
