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
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.components.loss import metrics_from_sums
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
from dflash_ds.runtime.monitor import Monitor, scrub_secrets
from dflash_ds.runtime.plan import DataPlan, batch_seed, last_step, payload_specs, resolve_arch, torch_dtype
from dflash_ds.runtime.target_worker import CONTROL_TAG
from dflash_ds.runtime.watchdog import EXIT_PREEMPTED, STOP_STEP_KEY, Watchdog

ANCHOR_SALT, NOISE_SALT = 1, 2
SUM_KEYS = ("valid_positions", "correct", "top4", "top8", "blocks", "streak", "tree_streak4", "tree_streak8")


class Receiver:
    """Background thread receiving this drafter's batches in step order from the routed targets.

    `specs_of(BatchSpec)` gives each batch's payload specs from the shared data plan
    (`plan.payload_specs`), so the receives of the next `depth` batches are posted before the
    targets have produced them.
    """

    def __init__(self, ctx: RoleContext, data: DataPlan, start_step: int, cursor: Cursor, max_steps: int,
                 specs_of, depth: int = 2) -> None:
        self.ctx, self.depth, self.q = ctx, depth, queue.Queue(maxsize=depth)
        # Reused receive buffers: fresh multi-MiB tensors per batch page-fault on every first touch.
        self.pool = bridge_mod.BufferPool(ctx.device, max_free=2 * depth + 2)
        self.thread = threading.Thread(target=self._work, args=(data, start_step, cursor, max_steps, specs_of),
                                       daemon=True, name="drafter-receiver")
        self.thread.start()

    def _work(self, data: DataPlan, start: int, cursor: Cursor, stop: int, specs_of) -> None:
        layout, d = self.ctx.layout, self.ctx.role_rank
        # The same walk over the data plan as the targets' (target_worker.my_batches).
        schedule = ((step * layout.num_drafters + d, layout.target_ranks[layout.route(step, d)], specs_of(specs[d]))
                    for step, (_, specs) in zip(range(start, stop), data.steps(cursor)))
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


def _load_drafter(cfg: Config, seed: int) -> DFlashDrafter:
    if cfg.drafter:
        return DFlashDrafter.from_pretrained(cfg.drafter)
    drafter = DFlashDrafter(resolve_arch(cfg))
    drafter.init_weights(seed)
    return drafter


def _check_resume_state(state: dict, arch, path: Path) -> None:
    """A checkpoint whose drafter shape, block size or target layers differ from the run -> clear error."""
    saved = state.get("arch", {})
    for key in ("block_size", "target_layer_ids", "num_hidden_layers", "hidden_size", "vocab_size", "mask_token_id"):
        if key in saved and saved[key] != getattr(arch, key):
            raise DFlashError(f"checkpoint {path} has {key} = {saved[key]} but this run has {getattr(arch, key)}")


def run_drafter(ctx: RoleContext, cfg: Config, data: DataPlan, watchdog: Watchdog) -> int:
    """Train until the last step (or a stop request), checkpoint, and return the exit status."""
    layout = ctx.layout
    d, n_d = ctx.role_rank, layout.num_drafters
    leader = d == 0
    out = Path(cfg.train.output_dir)
    cuda = ctx.device.type == "cuda"
    dtype = torch_dtype(cfg, cuda)
    if leader:
        ckpt.check_writable(out)
        ckpt.clean_partials(out)

    # Every drafter rank must agree on the resume point; the leader decides.
    decision = [str(ckpt.resolve_resume(cfg.train.resume, out) or "")] if leader else [None]
    dist.broadcast_object_list(decision, src=0)
    resume_path = Path(decision[0]) if decision[0] else None

    arch = resolve_arch(cfg)
    if resume_path is not None:  # cheap JSON check before the target head and the engine are built
        _check_resume_state(ckpt.read_state(resume_path), arch, resume_path)
    if leader:
        print(f"[dflash-ds] building the DeepSpeed engine on {n_d} drafter rank(s)...", flush=True)
    embed, head = load_target_head(cfg.target, dtype=dtype)
    module = DrafterTrainModule(_load_drafter(cfg, cfg.train.seed), embed, head)
    engine = build_engine(module, cfg, load_ds_config(resolve_ds_config(cfg), cfg, bf16=dtype == torch.bfloat16))

    start_step, cursor = 0, Cursor(0, 0)
    if resume_path is not None:
        state = ckpt.read_state(resume_path)
        engine.load_checkpoint(str(resume_path), tag=ckpt.DS_TAG, load_module_strict=True)
        start_step, cursor = int(state["step"]), Cursor(**state["cursor"])
    if leader:
        # On the bridge's device: NCCL moves only CUDA tensors.
        start = torch.tensor([start_step, cursor.epoch, cursor.batch_index], dtype=torch.long, device=ctx.device)
        sends = [(t, bridge_mod.send_batch(ctx.bridge, t, {"start": start}, {}, batch_id=-1, tag=CONTROL_TAG))
                 for t in layout.target_ranks]
        for t, works in sends:
            bridge_mod.wait_all(works, t, ctx.timeout_s, "sending the start point")
        print(f"[dflash-ds] {layout.describe()}; ZeRO-{engine.zero_optimization_stage()}; "
              f"{'resuming from ' + str(resume_path) if resume_path else 'fresh start'} at step {start_step}",
              flush=True)

    monitor = None
    if leader:
        monitor = Monitor(out, cfg.train.max_steps, config=scrub_secrets(to_dict(cfg)),
                          use_wandb=cfg.wandb.enabled, wandb_project=cfg.wandb.project,
                          wandb_run_name=cfg.wandb.run_name, resume_step=start_step)
    records_dir = out / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    record_file = (records_dir / f"drafter{d}.jsonl").open("a")

    def export_fn(folder: Path) -> None:
        state_dict = gathered_drafter_state(engine)
        if state_dict is not None:
            export = DFlashDrafter(arch)
            export.load_state_dict(state_dict, strict=False)
            export.save_pretrained(folder)

    def trainer_state(step: int, cur: Cursor) -> dict:
        return {"step": step, "cursor": asdict(cur), "seed": cfg.train.seed, "num_drafters": n_d,
                "arch": {"block_size": arch.block_size, "target_layer_ids": arch.target_layer_ids,
                         "num_hidden_layers": arch.num_hidden_layers, "hidden_size": arch.hidden_size,
                         "vocab_size": arch.vocab_size, "mask_token_id": arch.mask_token_id},
                "rng": "per-batch generators seeded by (seed, global batch id): nothing else to restore",
                "config": scrub_secrets(to_dict(cfg))}

    stop = last_step(cfg)
    receiver = Receiver(ctx, data, start_step, cursor, stop,
                        lambda spec: payload_specs(spec, arch, dtype, cfg.loss.kl_weight > 0), depth=2)
    n_buckets = len(data.boundaries)
    acc = torch.zeros(32 + n_buckets, dtype=torch.float64)
    t_last, steps_in_window, run_start = time.perf_counter(), 0, time.perf_counter()
    last_cursor = cursor
    inject_nan = {int(x) for x in os.environ.get("DFLASH_INJECT_NAN_STEPS", "").split(",") if x.strip()}
    skipped = consecutive_bad = 0
    for step in range(start_step, stop):
        watchdog.step = step
        faults.at_step(step)
        batch_id, tensors, meta, depth = receiver.get()
        expected = step * n_d + d
        if batch_id != expected:
            raise RuntimeError(f"drafter {d} expected global batch {expected} at step {step}, got {batch_id}")
        states = TargetStates(tensors["input_ids"], tensors["loss_mask"], tensors["lengths"],
                              tensors["context"].to(dtype), tensors.get("last_hidden"))
        noise = noise_std_at(step, max_std=cfg.noise.max_std, min_std=cfg.noise.min_std,
                             warmup_steps=cfg.noise.warmup_steps, total_steps=cfg.train.max_steps)
        lr = engine.get_lr()[0]
        terms, sums = engine(states, cfg.loss, batch_seed(cfg.train.seed, batch_id, ANCHOR_SALT), noise,
                             batch_seed(cfg.train.seed, batch_id, NOISE_SALT))
        loss_t = terms.loss * math.nan if (leader and step in inject_nan) else terms.loss  # fault injection (tests)
        loss = loss_t.item()
        # One tiny all-reduce per step keeps the drafters in agreement on skipping and stopping.
        flags = torch.tensor([0.0 if math.isfinite(loss) else 1.0, 1.0 if watchdog.stop_event.is_set() else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stopping = bool(flags[0]), bool(flags[1])
        grad_norm = math.nan
        if not bad:
            engine.backward(loss_t)
            engine.step()
            norm = engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else math.nan
            # fp32 has no overflow check in the optimizer: a non-finite norm is counted, not undone.
            bad = norm is not None and not math.isfinite(grad_norm)
        if bad:
            skipped += 1
            consecutive_bad += 1
            print(f"[dflash-ds] drafter {d}: non-finite loss or grad norm at step {step}: "
                  f"{'update skipped' if not math.isfinite(loss) else 'counted'} ({consecutive_bad} in a row)",
                  file=sys.stderr, flush=True)
            if consecutive_bad >= cfg.train.max_bad_steps:
                raise DFlashError(f"{consecutive_bad} consecutive steps with a non-finite loss or gradient norm "
                                  f"(last at step {step}); stopping. Last good checkpoint: {ckpt.find_latest(out)}")
        else:
            consecutive_bad = 0
        del states
        receiver.release(tensors)  # nothing below reads the batch's tensors
        record_file.write(json.dumps({"step": step, "batch_id": batch_id, "bucket": int(meta["bucket"]),
                                      "epoch_after": int(meta["epoch_after"]), "loss": loss,
                                      "skipped": bad, "target_rank": int(meta["target_rank"])}) + "\n")
        record_file.flush()
        last_cursor = Cursor(int(meta["epoch_after"]), int(meta["index_after"]))
        vec = [loss if math.isfinite(loss) else 0.0, 1.0] + [float(sums[k]) for k in SUM_KEYS] + [
            meta["real_tokens"], meta["padded_tokens"], meta["num_seqs"], float(depth), meta["tgt_batch_per_s"],
            meta["tgt_forward_s"], grad_norm if math.isfinite(grad_norm) else 0.0, lr, noise]
        acc[: len(vec)] += torch.tensor(vec, dtype=torch.float64)
        acc[19] = float(skipped)  # a running count, not a per-step sum
        acc[32 + int(meta["bucket"])] += 1
        pos = sums["pos_correct"], sums["pos_valid"]
        if steps_in_window == 0:
            pos_acc = [torch.zeros_like(pos[0], dtype=torch.float64), torch.zeros_like(pos[1], dtype=torch.float64)]
        pos_acc[0] += pos[0].double().cpu()
        pos_acc[1] += pos[1].double().cpu()
        steps_in_window += 1
        done = step + 1
        if done % cfg.train.log_interval == 0 or done == stop or stopping:
            total = torch.cat([acc, pos_acc[0], pos_acc[1]])
            dist.all_reduce(total)
            now = time.perf_counter()
            window = now - t_last
            if leader:
                monitor.log(_record(total, n_buckets, len(pos_acc[0]), done, last_cursor.epoch, window, n_d,
                                    layout.num_targets, cfg.train.max_steps,
                                    (now - run_start) / max(done - start_step, 1)))
            acc.zero_()
            steps_in_window, t_last = 0, now
        if stopping and leader:
            ctx.store.set(STOP_STEP_KEY, str(done))  # targets drop every batch from this step on
        # No periodic checkpoint inside a streak of bad steps: the last good one must stay the latest.
        if (done % cfg.train.save_interval == 0 and consecutive_bad == 0) or done == stop or stopping:
            ckpt.save_checkpoint(engine, done, out, trainer_state(done, last_cursor), cfg.train.keep_last, export_fn)
        if stopping:
            record_file.close()
            if monitor is not None:
                monitor.close()
                print(f"[dflash-ds] stop requested ({watchdog.stop_reason()}): checkpoint at step "
                      f"{done} in {ckpt.find_latest(out)}; exiting with status {EXIT_PREEMPTED}; "
                      f"--resume auto continues", flush=True)
            return EXIT_PREEMPTED
    record_file.close()
    if monitor is not None:
        monitor.close()
        print(f"[dflash-ds] done: step {stop} of {cfg.train.max_steps}; metrics {out / 'metrics.jsonl'}; "
              f"checkpoint {ckpt.find_latest(out)}", flush=True)
    return 0


def _record(total: torch.Tensor, n_buckets: int, k: int, step: int, epoch: int, window: float, n_d: int,
            n_t: int, max_steps: int, sec_per_step: float) -> dict:
    """Reduced sums of a log window -> one metrics.jsonl record."""
    v = total.tolist()
    loss_sum, n = v[0], v[1]  # n = steps x drafters in the window
    sums = {key: torch.tensor(v[2 + i]) for i, key in enumerate(SUM_KEYS)}
    real, padded, seqs, depth, tgt_rate, tgt_fwd, gnorm, lr, noise, skipped = v[10:20]  # v[19]: summed over D
    buckets = v[32:32 + n_buckets]
    sums["pos_correct"] = torch.tensor(v[32 + n_buckets: 32 + n_buckets + k])
    sums["pos_valid"] = torch.tensor(v[32 + n_buckets + k: 32 + n_buckets + 2 * k])
    m = metrics_from_sums(sums)
    steps = n / n_d
    return {
        "step": step, "epoch": epoch, "loss": loss_sum / n, **{key: m[key] for key in (
            "accuracy", "avg_streak", "tau", "top4_accuracy", "top8_accuracy", "tree_streak4", "tree_streak8")},
        "accuracy_per_position": m["accuracy_per_position"],
        "lr": lr / n, "noise_std": noise / n, "grad_norm": gnorm / n,
        # each header carries its target's own rate: the mean times T is the whole target side's
        "tgt_batch_per_sec": tgt_rate / n * n_t, "skipped_steps": skipped / n_d,
        "dft_batch_per_sec": n / window, "tok_per_sec": real / window,
        "hs_queue_depth": depth / n, "tgt_forward_s": tgt_fwd / n,
        "avg_seq_len": real / max(seqs, 1), "padding_efficiency": real / max(padded, 1),
        "bucket_pct": {str(b): c / n for b, c in enumerate(buckets)},
        "real_tokens": real, "padded_tokens": padded,
        "eta_s": sec_per_step * (max_steps - step), "step_time_s": window / max(steps, 1),
    }
