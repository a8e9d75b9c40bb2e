"""Drafter ranks: take target states from a batch source, train the drafter with DeepSpeed in lockstep, log, checkpoint.

The first drafter (global rank 0) is the leader: it picks the resume point and sends it to
every target, reduces metrics over the training group, writes metrics.jsonl / W&B, and
orchestrates checkpoints. The batches come over the bridge from the target ranks, or from the
target loaded on this rank when colocated (`runtime/sources.py`); everything after that is the
same code path (`runtime/step.py`).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

from dflash_ds.config import Config, to_dict
from dflash_ds.data.batching import Cursor
from dflash_ds.data.stream import BatchStream
from dflash_ds.distributed.topology import RoleContext
from dflash_ds.distributed.wire import send_start
from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter_arch import DrafterArch
from dflash_ds.runtime import checkpoint as ckpt
from dflash_ds.runtime import compile_cache, faults
from dflash_ds.runtime.engine import build_drafter_engine, check_shared_head, export_drafter
from dflash_ds.runtime.evaluate import validate
from dflash_ds.runtime.job import last_step, load_run_target
from dflash_ds.runtime.monitor import Monitor, scrub_secrets
from dflash_ds.runtime.resume import ResumePoint, agree_on_resume
from dflash_ds.runtime.sources import BatchSource, open_source
from dflash_ds.runtime.step import StepResult, optimizer_step
from dflash_ds.runtime.step_metrics import StepLog
from dflash_ds.runtime.watchdog import EXIT_PREEMPTED, STOP_SAVED_KEY, STOP_STEP_KEY, Watchdog


def run_drafter(ctx: RoleContext, cfg: Config, data: BatchStream, watchdog: Watchdog, resume: ResumePoint,
                arch: DrafterArch, dtype: torch.dtype) -> int:
    """Train until the last step (or a stop request), checkpoint, and return the exit status."""
    d, leader = ctx.data_rank, ctx.role_rank == 0  # d: which batch of a micro-step (its SP group's, if any)
    out, stop = Path(cfg.train.output_dir), last_step(cfg)
    if leader:
        _prepare_output(out, resume)
    resume = agree_on_resume(ctx, cfg, resume, arch, leader)
    data = replace(data, global_batch=resume.global_batch)  # the leader's word; the caller's stream is left as it is
    faults.before_build()
    if cfg.train.compile_cache:  # before anything compiles: flex_attention, the fused functions
        files, artifacts = compile_cache.load(out)
        if leader and files:
            print(f"[dflash-ds] compile cache: {artifacts} compiled artifact(s) loaded from "
                  f"{compile_cache.folder(out)}", flush=True)
    engine, target = _build_engine(ctx, cfg, data, resume, arch, dtype)
    start_step, cursor = _restore(engine, resume)
    if leader:
        _announce_start(ctx, engine, resume, start_step, cursor, data.global_batch)
    source = open_source(ctx, cfg, arch, dtype, data, start_step, cursor, stop, target)
    log = StepLog(out, ctx, data, arch.block_size, cfg.train.max_steps, start_step,
                  _open_monitor(cfg, out, start_step) if leader else None, cfg.train.est_tau_interval)
    consecutive_bad, best = 0, resume.best  # best: {"step", "val_est_tau"} of checkpoints/best, or None
    for step in range(start_step, stop):
        watchdog.step = step
        faults.at_step(step, watchdog.stop_requested)
        records = functools.partial(_records, cfg, data, step, stop)
        result = optimizer_step(engine, source, data, cfg, dtype, step, d, watchdog.stop_requested)
        log.add(step, result)
        consecutive_bad = consecutive_bad + 1 if result.bad else 0
        if result.bad:
            _report_bad_step(cfg, out, d, step, result, data.accumulation, consecutive_bad)
        done = step + 1
        figures = _evaluate_and_record(engine, source, log, data, cfg, dtype, step, d, result, records)
        if result.stopping and leader:
            ctx.store.set(STOP_STEP_KEY, str(done))  # targets drop every batch from this step on
        # No periodic or best checkpoint inside a streak of bad steps: the last good one must stay the latest.
        new_best = consecutive_bad == 0 and ckpt.improves(figures.get("val_est_tau"), best)
        best = {"step": done, "val_est_tau": figures["val_est_tau"]} if new_best else best
        if (done % cfg.train.save_interval == 0 and consecutive_bad == 0) or done == stop or result.stopping \
                or new_best:
            _save(engine, cfg, out, arch, dtype, data, ctx.role_world, done, result.cursor, figures, best, new_best)
            if leader and cfg.train.compile_cache:
                compile_cache.save(out)
        if result.stopping:
            if leader:  # save_checkpoint returned on every drafter: the targets, holding no state, may leave now
                ctx.store.set(STOP_SAVED_KEY, str(done))
            _finish(source, log)
            if leader:
                print(f"[dflash-ds] stop requested ({watchdog.stop_reason()}): checkpoint at step "
                      f"{done} in {ckpt.find_latest(out)}; exiting with status {EXIT_PREEMPTED}; "
                      f"--resume auto continues", flush=True)
            return EXIT_PREEMPTED
    _finish(source, log)
    if leader:
        best_note = f"; best {ckpt.find_best(out)} (val_est_tau {best['val_est_tau']:.3f})" if best else ""
        print(f"[dflash-ds] done: step {stop} of {cfg.train.max_steps}; metrics {out / 'metrics.jsonl'}; "
              f"checkpoint {ckpt.find_latest(out)}{best_note}", flush=True)
    return 0


def _prepare_output(out: Path, resume: ResumePoint) -> None:
    """The leader's start: a writable run folder without leftover partial saves; a fresh run forgets an old best."""
    ckpt.check_writable(out)
    ckpt.clean_partials(out)
    if resume.path is None:
        ckpt.forget_best(out)


def _records(cfg: Config, data: BatchStream, step: int, stop: int, stopping: bool) -> bool:
    """Whether a metric record follows step `step`: the log interval, an evaluation, the last step or a stop."""
    done = step + 1
    return done % cfg.train.log_interval == 0 or data.is_eval_step(step) or done == stop or stopping


def _evaluate_and_record(engine, source: BatchSource, log: StepLog, data: BatchStream, cfg: Config,
                         dtype: torch.dtype, step: int, d: int, result: StepResult, records) -> dict[str, float]:
    """The validation batches of an evaluation step (not when stopping), then the record if one is due.

    Returns the record's walk figures (est_tau, val_est_tau, ...), the same on every drafter, or {}."""
    if data.is_eval_step(step) and not result.stopping:
        log.window.add_walk("val", validate(engine, source, data, cfg, dtype, step, d, result.cursor))
    if not records(result.stopping):
        return {}
    return log.close_window(step + 1, result.cursor.epoch).walks()


def _build_engine(ctx: RoleContext, cfg: Config, data: BatchStream, resume: ResumePoint, arch: DrafterArch,
                  dtype: torch.dtype) -> tuple[object, torch.nn.Module | None]:
    """The DeepSpeed engine, and the target when colocated (loaded first: the engine shares its embedding and head)."""
    layout, leader = ctx.layout, ctx.role_rank == 0
    if leader:
        print(f"[dflash-ds] {'loading the target on every rank, ' if layout.colocated else ''}building the "
              f"DeepSpeed engine on {layout.num_drafters} drafter rank(s); global batch "
              f"{data.global_batch} = {layout.data_parallel} x {data.accumulation} accumulated micro-batch(es)"
              f"{f' (one per group of {layout.sequence_parallel})' if layout.sequence_parallel > 1 else ''}...",
              flush=True)
    target = None
    if layout.colocated:
        target = load_run_target(cfg, dtype, ctx.device, ctx.global_rank)
    engine = build_drafter_engine(cfg, arch, dtype, ctx.device, data.accumulation,
                                  universal=resume.mode == "universal", target=target,
                                  num_drafters=layout.num_drafters, resuming=resume.path is not None,
                                  sp_group=ctx.sp_group)
    if leader:
        print(f"[dflash-ds] activation checkpointing {engine.module.checkpointing_reason}", flush=True)
    if target is not None and leader:
        warning = check_shared_head(engine, target)
        if warning:
            print(f"[dflash-ds] warning: {warning}", file=sys.stderr, flush=True)
    return engine, target


def _restore(engine, resume: ResumePoint) -> tuple[int, Cursor]:
    """Load the agreed checkpoint into the engine; (start step, data cursor) of the run."""
    if resume.path is None:
        return 0, Cursor(0, 0)
    state = ckpt.read_state(resume.path)
    engine.load_checkpoint(str(resume.path), tag=resume.tag, load_module_strict=True)
    return int(state["step"]), Cursor(**state["cursor"])


def _announce_start(ctx: RoleContext, engine, resume: ResumePoint, start_step: int, cursor: Cursor,
                    global_batch: int) -> None:
    """The leader sends every target the start point and global batch, and says where the run starts."""
    layout = ctx.layout
    if layout.num_targets:
        send_start(ctx, start_step, cursor, global_batch)
    how = {"direct": "", "universal": f" (resharded from {resume.saved_drafters} drafter rank(s))"}
    print(f"[dflash-ds] {layout.describe()}; ZeRO-{engine.zero_optimization_stage()}; "
          f"{'resuming from ' + str(resume.path) + how[resume.mode] if resume.path else 'fresh start'} "
          f"at step {start_step}{engine.module.init_note}", flush=True)


def _open_monitor(cfg: Config, out: Path, start_step: int) -> Monitor:
    """The leader's metrics.jsonl (and W&B) writer."""
    return Monitor(out, cfg.train.max_steps, config=scrub_secrets(to_dict(cfg)), use_wandb=cfg.wandb.enabled,
                   wandb_project=cfg.wandb.project, wandb_run_name=cfg.wandb.run_name, resume_step=start_step)


def _report_bad_step(cfg: Config, out: Path, d: int, step: int, result: StepResult, accumulation: int,
                     consecutive: int) -> None:
    """Say what was skipped; stop with an error after train.max_bad_steps in a row."""
    bad = sum(not math.isfinite(r.loss) for r in result.micro)
    what = ("counted (grad norm)" if not bad else "update skipped" if accumulation == 1
            else f"{bad} of {accumulation} micro-batch(es) dropped from the update")
    print(f"[dflash-ds] drafter {d}: non-finite loss or grad norm at step {step}: {what} ({consecutive} in a row)",
          file=sys.stderr, flush=True)
    if consecutive >= cfg.train.max_bad_steps:
        raise DFlashError(f"{consecutive} consecutive steps with a non-finite loss or gradient norm "
                          f"(last at step {step}); stopping. Last good checkpoint: {ckpt.find_latest(out)}")


def _save(engine, cfg: Config, out: Path, arch: DrafterArch, dtype: torch.dtype, data: BatchStream, ranks: int,
          step: int, cursor: Cursor, figures: dict, best: dict | None, new_best: bool) -> None:
    """The checkpoint of step `step` (collective over the `ranks` drafters; the HF export gathered on the leader).

    Its state keeps this step's validation figures and the best so far; `new_best` makes it checkpoints/best."""
    val = {k: v for k, v in figures.items() if k.startswith("val_")}
    state = ckpt.trainer_state(cfg, arch, ranks, data.global_batch, engine.zero_optimization_stage(),
                               dtype, step, cursor, val=val, best=best)
    ckpt.save_checkpoint(engine, step, out, state, cfg.train.keep_last,
                         lambda folder: export_drafter(engine, arch, dtype, folder, notes=export_notes(cfg)),
                         best=new_best)


def export_notes(cfg: Config) -> dict:
    """What an export trained on, written beside its shape: the recipe in force and the loss section."""
    return {"recipe": cfg.recipe, "loss": to_dict(cfg)["loss"]}


def _finish(source: BatchSource, log: StepLog) -> None:
    """Stop the batch source, close the records and the leader's monitor."""
    source.close()
    log.close()
