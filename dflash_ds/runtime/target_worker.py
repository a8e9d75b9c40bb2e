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
from dflash_ds.runtime.plan import DataPlan, check_global_batch, last_step, payload_specs, resolve_arch, torch_dtype

CONTROL_TAG = 7


def receive_start(ctx: RoleContext, leader: int, timeout_s: float) -> tuple[int, Cursor, int]:
    """The resume point (start step, data cursor) and the global batch chosen by the leader once its engine is up."""
    _, tensors, _ = bridge_mod.recv_batch(ctx.bridge, leader, timeout_s=timeout_s, tag=CONTROL_TAG, device=ctx.device)
    start = tensors["start"].tolist()
    return int(start[0]), Cursor(int(start[1]), int(start[2])), int(start[3])


def run_target(ctx: RoleContext, cfg: Config, data: DataPlan, watchdog: Watchdog) -> int:
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


def batch_meta(spec, after: Cursor, forward_s: float, batches_per_s: float, in_flight: int, target_rank: int) -> dict:
    """The header meta of one batch, as the drafter's metrics read it (a colocated rank builds the same).

    Keys are at most 16 ASCII bytes (see bridge.py).
    """
    return {"bucket": spec.bucket, "epoch_after": after.epoch, "index_after": after.batch_index,
            "real_tokens": spec.real_tokens, "padded_tokens": spec.padded_tokens, "num_seqs": spec.num_seqs,
            "tgt_forward_s": forward_s, "tgt_batch_per_s": batches_per_s, "in_flight": in_flight,
            "target_rank": target_rank}


def build_payload(sender: bridge_mod.AsyncSender, planned: list, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  lengths: torch.Tensor, layers: list[torch.Tensor],
                  last_hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A batch's bridge payload, written straight into a pooled send buffer (sent without a further copy).

    `planned` is `plan.payload_specs` of the batch, the shapes the drafter has already posted its
    receive for: a batch that differs is an error here, before anything is sent. The selected
    layers are concatenated into the buffer's `context`, which the concatenation needed anyway;
    `last_hidden` (for the KL term) is one extra copy of H values per token.
    """
    context_shape = (*layers[0].shape[:-1], sum(t.shape[-1] for t in layers))
    specs = [("input_ids", input_ids.dtype, tuple(input_ids.shape)), ("loss_mask", loss_mask.dtype, tuple(loss_mask.shape)),
             ("lengths", lengths.dtype, tuple(lengths.shape)), ("context", layers[0].dtype, context_shape)]
    if last_hidden is not None:
        specs.append(("last_hidden", last_hidden.dtype, tuple(last_hidden.shape)))
    if specs != planned:
        raise DFlashError(f"the target produced a batch of {bridge_mod.describe_specs(specs)}, but the data plan says "
                          f"{bridge_mod.describe_specs(planned)} (is the target's dtype the run's dtype?)")
    out = sender.empty(specs)
    out["input_ids"].copy_(input_ids)
    out["loss_mask"].copy_(loss_mask)
    out["lengths"].copy_(lengths)
    torch.cat(layers, dim=-1, out=out["context"])
    if last_hidden is not None:
        out["last_hidden"].copy_(last_hidden)
    return out
