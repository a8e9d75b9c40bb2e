"""The drafter's micro-step, as the trainer, `bench` and `train-step` all take it.

forward -> agree -> accumulate: the loss of one batch (`forward`), one tiny all-reduce in which
every drafter learns whether any loss was not finite and whether a stop was asked for (`agree`),
then DeepSpeed's backward and step (`accumulate`), the step's update happening at its last
micro-batch. `optimizer_step` is the trainer's whole optimizer step over a batch source;
`bench pipeline` times `train_micro` alone and `dflash-ds train-step` calls `forward` with a
plain module and optimizer (one device, no DeepSpeed).

Anchors and noise of a batch come from generators seeded by (seed, global batch id), so a step
is a pure function of the batch and the weights: a resumed run and an uninterrupted one agree.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist

from dflash_ds.components.objective import TargetStates
from dflash_ds.components.schedules import noise_std_at
from dflash_ds.config import Config, LossConfig
from dflash_ds.data.batching import Cursor
from dflash_ds.models.kinds import kind_specs
from dflash_ds.runtime import faults
from dflash_ds.runtime.evaluate import estimate, pooled_walks, walks_at

if TYPE_CHECKING:
    from dflash_ds.data.stream import BatchStream
    from dflash_ds.runtime.sources import BatchSource, SourcedBatch

ANCHOR_SALT, NOISE_SALT = 1, 2


def batch_seed(seed: int, global_batch: int, salt: int) -> int:
    """Seed of a per-batch generator (anchors, noise): a pure function, so resume is exact."""
    return (seed * 1_000_003 + global_batch * 7919 + salt) % (2**63 - 1)


class MicroResult(NamedTuple):
    """What one micro-batch left behind for the records and the metric window."""

    micro: int  # its index in the optimizer step
    batch_id: int  # global batch id
    loss: float  # as computed, NaN included
    sums: dict  # the objective's loss statistics
    meta: dict  # the batch's header meta (wire.batch_meta)
    depth: int  # batches already waiting when it was taken
    skipped: bool  # some drafter's loss was not finite: dropped from the update


class StepResult(NamedTuple):
    """One optimizer step of this drafter."""

    micro: list[MicroResult]
    grad_norm: float  # NaN when the update was skipped
    lr: float
    noise: float
    bad: bool  # a micro-batch was dropped, or the gradient norm is not finite
    stopping: bool  # the drafters agreed to stop after this step
    est: dict | None = None  # walk sums of est_tau on the first micro-batch (runtime/evaluate.py), at a walk step
    est_walks: int = 0  # walks a record's est_tau pools (evaluate.pooled_walks; step_metrics.WalkHistory)

    @property
    def cursor(self) -> Cursor:
        """The data cursor after this step (every micro-batch of a step carries the same one)."""
        meta = self.micro[-1].meta
        return Cursor(int(meta["epoch_after"]), int(meta["index_after"]))


def noise_at(cfg: Config, step: int) -> float:
    """The context noise std of optimizer step `step` (components/schedules)."""
    return noise_std_at(step, max_std=cfg.noise.max_std, min_std=cfg.noise.min_std,
                        warmup_steps=cfg.noise.warmup_steps, total_steps=cfg.train.max_steps)


def loss_at(cfg: Config, step: int) -> LossConfig:
    """The loss settings of optimizer step `step`: cfg.loss as each drafter kind schedules its own loss.* fields
    (`KindSpec.loss_at`, e.g. a warm-up of its term's weight); cfg.loss itself when none changes it."""
    loss = cfg.loss
    for spec in kind_specs():  # every kind's: with --drafter the folder, not model.kind, names the run's kind
        if spec.loss_at is not None:
            loss = spec.loss_at(loss, step)
    return loss


def forward(model, tensors: dict, loss_cfg: LossConfig, seed: int, batch_id: int, noise: float,
            dtype: torch.dtype):
    """The micro-batch's (loss terms, statistics); `model` is the DeepSpeed engine or its bare module.

    Anchors and noise are seeded by (seed, global batch id), whichever rank computes it.
    """
    states = TargetStates(tensors["input_ids"], tensors["loss_mask"], tensors["lengths"],
                          tensors["context"].to(dtype), tensors.get("last_hidden"))
    return model(states, loss_cfg, batch_seed(seed, batch_id, ANCHOR_SALT), noise,
                 batch_seed(seed, batch_id, NOISE_SALT))


def agree(loss_finite: bool, stop_requested: bool) -> tuple[bool, bool]:
    """(skip this update, stop after this step), agreed by every drafter in one tiny all-reduce.

    A host tensor: on GPU the role group carries CPU tensors over gloo (topology.ROLE_BACKENDS).
    """
    flags = torch.tensor([0.0 if loss_finite else 1.0, 1.0 if stop_requested else 0.0])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def accumulate(engine, loss: torch.Tensor | None, accumulation: int, tensors: dict, cfg: Config,
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
        zeroed.pop("last_hidden", None)  # no KL / LK / target labels: the target's logits may be what was not finite
        loss = forward(engine, zeroed, cfg.loss, cfg.train.seed, batch_id, 0.0, dtype)[0].loss * 0.0
    engine.backward(loss)
    engine.step()


def train_micro(engine, batch: SourcedBatch, micro: int, cfg: Config, dtype: torch.dtype, noise: float,
                accumulation: int, stop_requested: bool,
                poison: Callable[[torch.Tensor], torch.Tensor] | None = None,
                loss_cfg: LossConfig | None = None) -> tuple[MicroResult, bool]:
    """forward -> agree -> accumulate of one batch; returns its result and whether the drafters stop.

    `poison` may replace the loss before anyone reads it (test fault injection: faults.poison_loss);
    `loss_cfg` is the step's (`loss_at`), cfg.loss when not given.
    """
    terms, sums = forward(engine, batch.tensors, loss_cfg or cfg.loss, cfg.train.seed, batch.batch_id, noise, dtype)
    loss_t = terms.loss if poison is None else poison(terms.loss)
    loss = loss_t.item()
    skip, stop = agree(math.isfinite(loss), stop_requested)
    accumulate(engine, None if skip else loss_t, accumulation, batch.tensors, cfg, dtype, batch.batch_id)
    return MicroResult(micro, batch.batch_id, loss, sums, batch.meta, batch.depth, skip), stop


def step_grad_norm(engine, micro: list[MicroResult], accumulation: int) -> tuple[float, bool]:
    """(gradient norm, bad step) once a step's micro-batches are in: NaN when its update was skipped.

    A non-finite norm in fp32 is counted as bad, not undone (DeepSpeed has already stepped).
    """
    skipped = any(r.skipped for r in micro)
    norm = None if skipped and accumulation == 1 else engine.get_global_grad_norm()
    grad_norm = math.nan if norm is None else float(norm)
    return grad_norm, skipped or (norm is not None and not math.isfinite(grad_norm))


def optimizer_step(engine, source: BatchSource, data: BatchStream, cfg: Config, dtype: torch.dtype, step: int,
                   drafter: int, stop_requested: Callable[[], bool]) -> StepResult:
    """This drafter's optimizer step `step`: its A micro-batches from `source`, in the order of the batch stream.

    At a walk step (`evaluate.walks_at`) est_tau is measured on `train.est_tau_rows` rows of the first
    micro-batch before it trains.
    """
    acc, n_d = data.accumulation, data.num_drafters
    lr, noise = engine.get_lr()[0], noise_at(cfg, step)
    micro, stopping, est = [], False, None
    for m in range(acc):
        batch = source.get()
        expected = (step * acc + m) * n_d + drafter
        if batch.batch_id != expected:
            raise RuntimeError(f"drafter {drafter} expected global batch {expected} at step {step}, "
                               f"got {batch.batch_id}")
        if m == 0 and walks_at(cfg, step):  # the same steps on every drafter (the walk is collective)
            t0 = time.perf_counter()  # its cost, in records/walks{d}.jsonl (walk_sums read the host: it is done)
            est = {**estimate(engine, batch.tensors, cfg, dtype, rows=cfg.train.est_tau_rows),
                   "walk_s": time.perf_counter() - t0}
        result, stop_now = train_micro(engine, batch, m, cfg, dtype, noise, acc, stop_requested(),
                                       poison=functools.partial(faults.poison_loss, step, m, drafter == 0),
                                       loss_cfg=loss_at(cfg, step))
        stopping = stopping or stop_now
        source.release(batch.tensors)  # nothing below reads the batch's tensors
        micro.append(result)
    grad_norm, bad = step_grad_norm(engine, micro, acc)
    return StepResult(micro, grad_norm, lr, noise, bad, stopping, est, pooled_walks(cfg, n_d))
