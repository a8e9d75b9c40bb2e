"""Drafter ranks: receive target states, train the drafter with DeepSpeed in lockstep, log, checkpoint.

The first drafter (global rank 0) is the leader: it picks the resume point and sends it to
every target, reduces metrics over the training group, writes metrics.jsonl / W&B, and
orchestrates checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import sys
import queue
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.components.objective import TargetStates
from dflash_ds.components.schedules import noise_std_at
from dflash_ds.config import Config, to_dict
from dflash_ds.data.batching import Cursor
from dflash_ds.distributed import bridge as bridge_mod
from dflash_ds.distributed.topology import RoleContext
from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.target import load_target_head
from dflash_ds.runtime import checkpoint as ckpt
from dflash_ds.runtime import faults
from dflash_ds.runtime.engine import (DrafterTrainModule, build_engine, gathered_drafter_state, load_ds_config,
                                      resolve_ds_config)
from dflash_ds.data.stream import BatchStream
from dflash_ds.distributed.wire import payload_specs, send_start
from dflash_ds.runtime.job import last_step, resolve_arch, torch_dtype
from dflash_ds.runtime.memory import peak_memory_bytes, reset_peak_memory
from dflash_ds.runtime.monitor import Monitor, scrub_secrets
from dflash_ds.runtime.resume import ResumePlan, convert_to_universal, universal_ready
from dflash_ds.runtime.step import ANCHOR_SALT, NOISE_SALT, batch_seed
from dflash_ds.runtime.step_metrics import MetricWindow
from dflash_ds.runtime.watchdog import EXIT_PREEMPTED, STOP_STEP_KEY, Watchdog

class Receiver:
    """Background thread receiving this drafter's batches in step order from the routed targets.

    `specs_of(BatchSpec)` gives each batch's payload specs from the shared data plan
    (`plan.payload_specs`), so the receives of the next `depth` batches are posted before the
    targets have produced them.
    """

    def __init__(self, ctx: RoleContext, data: BatchStream, start_step: int, cursor: Cursor, max_steps: int,
                 specs_of, depth: int = 2) -> None:
        self.ctx, self.depth, self.q = ctx, depth, queue.Queue(maxsize=depth)
        # Reused receive buffers: fresh multi-MiB tensors per batch page-fault on every first touch.
        self.pool = bridge_mod.BufferPool(ctx.device, max_free=2 * depth + 2)
        self.thread = threading.Thread(target=self._work, args=(data, start_step, cursor, max_steps, specs_of),
                                       daemon=True, name="drafter-receiver")
        self.thread.start()

    def _work(self, data: BatchStream, start: int, cursor: Cursor, stop: int, specs_of) -> None:
        layout, d = self.ctx.layout, self.ctx.role_rank
        # The same walk over the data plan as the targets' (target_worker.my_batches).
        schedule = ((ms.batch_id(d), layout.target_ranks[layout.route(ms.index, d)], specs_of(ms.specs[d]))
                    for ms in data.micro_steps(start, cursor, stop))
        try:
            for got in bridge_mod.Receiver(self.ctx.bridge, schedule, depth=self.depth, timeout_s=self.ctx.timeout_s,
                                           device=self.ctx.device, pool=self.pool):
                self.q.put(got)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop
            self.q.put(exc)

    def get(self) -> tuple[int, dict, dict, int]:
        """Next batch and how many were already waiting (the queue depth the step saw)."""
        depth = self.q.qsize()
        try:
            item = self.q.get(timeout=self.ctx.timeout_s * 2)
        except queue.Empty:
            raise TimeoutError(f"no batch from any target within {self.ctx.timeout_s * 2:.0f}s") from None
        if isinstance(item, BaseException):
            raise item
        return (*item, depth)

    def release(self, tensors: dict) -> None:
        """The step is done with this batch: its buffer may receive a later one."""
        self.pool.release(tensors)

    def close(self) -> None:
        """Nothing to stop: the thread ends with its schedule (or with the process, a daemon)."""


def _load_drafter(cfg: Config, seed: int) -> DFlashDrafter:
    if cfg.drafter:
        return DFlashDrafter.from_pretrained(cfg.drafter)
    drafter = DFlashDrafter(resolve_arch(cfg))
    drafter.init_weights(seed)
    return drafter


def _check_resume_state(state: dict, arch, path: Path) -> None:
    """A checkpoint whose drafter shape, block size or target layers differ from the run -> clear error."""
    saved = state.get("arch", {})
    for key in ("block_size", "target_layer_ids", "num_hidden_layers", "hidden_size", "vocab_size", "mask_token_id",
                "layer_types", "sliding_window"):
        if key in saved and saved[key] != getattr(arch, key):
            raise DFlashError(f"checkpoint {path} has {key} = {saved[key]} but this run has {getattr(arch, key)}")


def run_drafter(ctx: RoleContext, cfg: Config, data: BatchStream, watchdog: Watchdog, resume: ResumePlan) -> int:
    """Train until the last step (or a stop request), checkpoint, and return the exit status."""
    layout = ctx.layout
    d, n_d = ctx.role_rank, layout.num_drafters
    leader = d == 0
    out = Path(cfg.train.output_dir)
    dtype = torch_dtype(cfg, ctx.device.type == "cuda")
    if leader:
        ckpt.check_writable(out)
        ckpt.clean_partials(out)
    arch = resolve_arch(cfg)
    resume = _agree_on_resume(ctx, cfg, resume, arch, leader)
    data.global_batch = resume.global_batch
    acc = data.accumulation
    if leader:
        print(f"[dflash-ds] {'loading the target on every rank, ' if layout.colocated else ''}building the "
              f"DeepSpeed engine on {n_d} drafter rank(s); global batch "
              f"{data.global_batch} = {n_d} x {acc} accumulated micro-batch(es)...", flush=True)
    target = None
    if layout.colocated:  # before the engine: the drafter shares the target's embedding and head
        from dflash_ds.models.target import load_target

        target = load_target(cfg.target, dtype=dtype, device=ctx.device)
    engine = _build(cfg, ctx, dtype, acc, universal=resume.mode == "universal", target=target)
    if target is not None and leader:
        from dflash_ds.runtime.colocated import check_shared_head

        warning = check_shared_head(engine, target)
        if warning:
            print(f"[dflash-ds] warning: {warning}", file=sys.stderr, flush=True)
    start_step, cursor = 0, Cursor(0, 0)
    if resume.path is not None:
        state = ckpt.read_state(resume.path)
        engine.load_checkpoint(str(resume.path), tag=resume.tag, load_module_strict=True)
        start_step, cursor = int(state["step"]), Cursor(**state["cursor"])
    if leader:
        if layout.num_targets:
            send_start(ctx, start_step, cursor, data.global_batch)
        how = {"direct": "", "universal": f" (resharded from {resume.saved_drafters} drafter rank(s))"}
        print(f"[dflash-ds] {layout.describe()}; ZeRO-{engine.zero_optimization_stage()}; "
              f"{'resuming from ' + str(resume.path) + how[resume.mode] if resume.path else 'fresh start'} "
              f"at step {start_step}", flush=True)
    monitor = Monitor(out, cfg.train.max_steps, config=scrub_secrets(to_dict(cfg)), use_wandb=cfg.wandb.enabled,
                      wandb_project=cfg.wandb.project, wandb_run_name=cfg.wandb.run_name,
                      resume_step=start_step) if leader else None
    records_dir = out / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    record_file = (records_dir / f"drafter{d}.jsonl").open("a")

    stop = last_step(cfg)
    if target is not None:
        from dflash_ds.runtime.colocated import LocalTargets

        receiver = LocalTargets(ctx, target, data, start_step, cursor, stop, arch.target_layer_ids,
                                cfg.loss.kl_weight > 0, prefetch=cfg.data.prefetch, overlap=cfg.topology.colocate_overlap)
    else:
        receiver = Receiver(ctx, data, start_step, cursor, stop,
                            lambda spec: payload_specs(spec, arch, dtype, cfg.loss.kl_weight > 0), depth=2)
    window = MetricWindow(len(data.boundaries), arch.block_size - 1, n_d, d)
    reset_peak_memory(ctx.device)
    t_last, run_start, last_cursor = time.perf_counter(), time.perf_counter(), cursor
    inject_nan = {int(x) for x in os.environ.get("DFLASH_INJECT_NAN_STEPS", "").split(",") if x.strip()}
    consecutive_bad = 0
    for step in range(start_step, stop):
        watchdog.step = step
        faults.at_step(step)
        noise = noise_std_at(step, max_std=cfg.noise.max_std, min_std=cfg.noise.min_std,
                             warmup_steps=cfg.noise.warmup_steps, total_steps=cfg.train.max_steps)
        lr = engine.get_lr()[0]
        micro, stopping, any_bad = [], False, False
        for m in range(acc):
            batch_id, tensors, meta, depth = receiver.get()
            expected = (step * acc + m) * n_d + d
            if batch_id != expected:
                raise RuntimeError(f"drafter {d} expected global batch {expected} at step {step}, got {batch_id}")
            terms, sums = _forward(engine, tensors, cfg, dtype, batch_id, noise)
            inject = leader and step in inject_nan and m == 0  # fault injection (tests)
            loss_t = terms.loss * math.nan if inject else terms.loss
            loss = loss_t.item()
            bad, stop_now = _agree_on_step(math.isfinite(loss), watchdog.stop_event.is_set())
            stopping, any_bad = stopping or stop_now, any_bad or bad
            _accumulate(engine, None if bad else loss_t, acc, tensors, cfg, dtype, batch_id)
            receiver.release(tensors)  # nothing below reads the batch's tensors
            micro.append((m, batch_id, loss, sums, meta, depth, bad))
        norm = engine.get_global_grad_norm() if not (any_bad and acc == 1) else None
        grad_norm = math.nan if norm is None else float(norm)
        bad_step = any_bad or (norm is not None and not math.isfinite(grad_norm))  # fp32: counted, not undone
        consecutive_bad = consecutive_bad + 1 if bad_step else 0
        for m, batch_id, loss, sums, meta, depth, bad in micro:
            if bad:
                window.skipped_total += 1
            record_file.write(json.dumps({"step": step, "micro": m, "batch_id": batch_id, "bucket": int(meta["bucket"]),
                                          "epoch_after": int(meta["epoch_after"]), "loss": loss, "skipped": bad,
                                          "target_rank": int(meta["target_rank"])}) + "\n")
            window.add_step(loss, sums, meta, depth, grad_norm, lr, noise)
        record_file.flush()
        if bad_step:
            _report_bad_step(cfg, out, d, step, [x[2] for x in micro], acc, consecutive_bad)
        last_cursor = Cursor(int(micro[-1][4]["epoch_after"]), int(micro[-1][4]["index_after"]))
        done = step + 1
        if done % cfg.train.log_interval == 0 or done == stop or stopping:
            window.peak_mem_bytes = peak_memory_bytes(ctx.device)
            totals = window.reduce()  # host tensors: the role group carries them on GPU too (cpu:gloo)
            now = time.perf_counter()
            if leader:
                monitor.log(totals.record(done, last_cursor.epoch, now - t_last, data.global_batch, n_d,
                                          layout.num_targets or n_d, cfg.train.max_steps,
                                          (now - run_start) / max(done - start_step, 1)))
            window.clear()
            reset_peak_memory(ctx.device)
            t_last = now
        if stopping and leader:
            ctx.store.set(STOP_STEP_KEY, str(done))  # targets drop every batch from this step on
        # No periodic checkpoint inside a streak of bad steps: the last good one must stay the latest.
        if (done % cfg.train.save_interval == 0 and consecutive_bad == 0) or done == stop or stopping:
            state = _trainer_state(cfg, arch, n_d, data.global_batch, engine, dtype, done, last_cursor)
            ckpt.save_checkpoint(engine, done, out, state, cfg.train.keep_last,
                                 lambda folder: _export(engine, arch, dtype, folder))
        if stopping:
            _finish(record_file, monitor, receiver)
            if monitor is not None:
                print(f"[dflash-ds] stop requested ({watchdog.stop_reason()}): checkpoint at step "
                      f"{done} in {ckpt.find_latest(out)}; exiting with status {EXIT_PREEMPTED}; "
                      f"--resume auto continues", flush=True)
            return EXIT_PREEMPTED
    _finish(record_file, monitor, receiver)
    if monitor is not None:
        print(f"[dflash-ds] done: step {stop} of {cfg.train.max_steps}; metrics {out / 'metrics.jsonl'}; "
              f"checkpoint {ckpt.find_latest(out)}", flush=True)
    return 0


def _agree_on_resume(ctx: RoleContext, cfg: Config, mine: ResumePlan, arch, leader: bool) -> ResumePlan:
    """Every drafter resumes as the leader decided (checked against the run's shape), resharded if needed.

    The leader converts the shards to the universal format when the drafter count changed; the
    others wait on the store (the conversion reads every optimizer state: minutes at real scale,
    longer than a collective's timeout).
    """
    decision = [mine if leader else None]
    dist.broadcast_object_list(decision, src=0)
    plan: ResumePlan = decision[0]
    if plan.path is None:
        return plan
    _check_resume_state(ckpt.read_state(plan.path), arch, plan.path)  # cheap JSON, before any model
    if plan.mode == "universal":
        key = f"dflash/universal/{plan.path.name}"
        if leader:
            try:
                convert_to_universal(plan.path, log=lambda msg: print(msg, flush=True))
            finally:
                ctx.store.set(key, "ok" if universal_ready(plan.path) else "failed")
        else:
            ctx.store.wait([key], timedelta(seconds=cfg.train.startup_timeout_s))
            if ctx.store.get(key).decode() != "ok":
                raise DFlashError(f"checkpoint {plan.path}: the leader could not reshard it (see rank 0's error)")
    return plan


def _build(cfg: Config, ctx: RoleContext, dtype: torch.dtype, accumulation: int, universal: bool, target=None):
    """The DeepSpeed engine over the drafter, with the target's frozen embedding and LM head.

    Those two are read from the target's safetensors, or shared with the loaded target (colocated).
    """
    if target is not None:
        from dflash_ds.runtime.colocated import frozen_head

        embed, head = frozen_head(target)
    else:
        embed, head = load_target_head(cfg.target, dtype=dtype)
    drafter = _load_drafter(cfg, cfg.train.seed).to(dtype)  # an export may be bf16 (a bf16 target's init)
    ac = cfg.model.activation_checkpointing
    drafter.activation_checkpointing = ctx.device.type == "cuda" if ac is None else ac
    module = DrafterTrainModule(drafter, embed, head)
    ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=dtype == torch.bfloat16, accumulation=accumulation,
                        load_universal=universal)
    return build_engine(module, cfg, ds)




def _forward(engine, tensors: dict, cfg: Config, dtype: torch.dtype, batch_id: int, noise: float):
    """The micro-step's loss and statistics; anchors and noise seeded by (seed, global batch id)."""
    states = TargetStates(tensors["input_ids"], tensors["loss_mask"], tensors["lengths"],
                          tensors["context"].to(dtype), tensors.get("last_hidden"))
    return engine(states, cfg.loss, batch_seed(cfg.train.seed, batch_id, ANCHOR_SALT), noise,
                  batch_seed(cfg.train.seed, batch_id, NOISE_SALT))


def _agree_on_step(loss_finite: bool, stop_requested: bool) -> tuple[bool, bool]:
    """(skip this update, stop after this step), agreed by every drafter in one tiny all-reduce.

    A host tensor: on GPU the role group carries CPU tensors over gloo (topology.ROLE_BACKENDS).
    """
    flags = torch.tensor([0.0 if loss_finite else 1.0, 1.0 if stop_requested else 0.0])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def _accumulate(engine, loss: torch.Tensor | None, accumulation: int, tensors: dict, cfg: Config,
                dtype: torch.dtype, batch_id: int) -> None:
    """One micro-batch's backward and DeepSpeed step (the update happens at the step's last micro-batch).

    DeepSpeed scales each loss by 1 / accumulation, so a step's gradient is the mean over its global
    batch whatever the drafter count. A non-finite micro-batch (loss None, agreed by every drafter):
    with no accumulation the whole update is skipped; with accumulation its gradient is dropped from
    the step, by a backward of zero times the loss of a zero-context forward, so every rank's
    DeepSpeed keeps the same micro-step count and the step's boundary stays where it is.
    """
    if loss is None and accumulation == 1:
        return
    if loss is None:
        zeroed = dict(tensors, context=torch.zeros_like(tensors["context"]))
        zeroed.pop("last_hidden", None)  # no KL term: the target's logits may be what was not finite
        loss = _forward(engine, zeroed, cfg, dtype, batch_id, 0.0)[0].loss * 0.0
    engine.backward(loss)
    engine.step()


def _report_bad_step(cfg: Config, out: Path, d: int, step: int, losses: list[float], accumulation: int,
                     consecutive: int) -> None:
    """Say what was skipped; stop with an error after train.max_bad_steps in a row."""
    bad = sum(not math.isfinite(x) for x in losses)
    what = ("counted (grad norm)" if not bad else "update skipped" if accumulation == 1
            else f"{bad} of {accumulation} micro-batch(es) dropped from the update")
    print(f"[dflash-ds] drafter {d}: non-finite loss or grad norm at step {step}: {what} ({consecutive} in a row)",
          file=sys.stderr, flush=True)
    if consecutive >= cfg.train.max_bad_steps:
        raise DFlashError(f"{consecutive} consecutive steps with a non-finite loss or gradient norm "
                          f"(last at step {step}); stopping. Last good checkpoint: {ckpt.find_latest(out)}")


def _trainer_state(cfg: Config, arch, n_d: int, global_batch: int, engine, dtype: torch.dtype, step: int,
                   cur: Cursor) -> dict:
    """trainer_state.json: where the run is, how it trains (resharding reads this) and the drafter shape."""
    return {"step": step, "cursor": asdict(cur), "seed": cfg.train.seed, "num_drafters": n_d,
            # informational: a colocated checkpoint resumes disaggregated on the same drafter count, and back
            "colocated": bool(cfg.topology.colocate),
            "global_batch": global_batch, "zero_stage": engine.zero_optimization_stage(),
            "dtype": str(dtype).removeprefix("torch."),
            "arch": {"block_size": arch.block_size, "target_layer_ids": arch.target_layer_ids,
                     "num_hidden_layers": arch.num_hidden_layers, "hidden_size": arch.hidden_size,
                     "vocab_size": arch.vocab_size, "mask_token_id": arch.mask_token_id,
                     "layer_types": arch.layer_types, "sliding_window": arch.sliding_window},
            "rng": "per-batch generators seeded by (seed, global batch id): nothing else to restore",
            "config": scrub_secrets(to_dict(cfg))}


def _export(engine, arch, dtype: torch.dtype, folder: Path) -> None:
    """The HF export in the training dtype (gathered on rank 0 under ZeRO-3; collective)."""
    state_dict = gathered_drafter_state(engine)
    if state_dict is not None:
        export = DFlashDrafter(arch)
        export.load_state_dict(state_dict, strict=False)
        export.to(dtype).save_pretrained(folder)


def _finish(record_file, monitor, receiver) -> None:
    receiver.close()
    record_file.close()
    if monitor is not None:
        monitor.close()
