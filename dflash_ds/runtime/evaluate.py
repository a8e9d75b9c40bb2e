"""est_tau on the drafter ranks: every `train.est_tau_interval` steps, and on the validation split at each evaluation.

`estimate` runs components/acceptance on one batch through the DeepSpeed engine (its forward, so
ZeRO-3 gathers and releases the drafter's weights as in training), no-grad, the drafter in eval
mode, no noise: nothing of it reaches a gradient. The blocks run
`loss.max_anchors_per_batch` at a time; under ZeRO-3 every drafter must run the same number of
forwards, so the drafters agree on the most any of them needs (one small all-reduce) and the
others run idle ones (a single padding block). It happens only at a walk step (`walks_at`) or on
validation batches: the micro-steps in between read the device no more than before
(tests/test_core/test_host_syncs.py).

At a walk step the walk reads `train.est_tau_rows` rows of the step's first micro-batch, spread over
it (`walk_rows`: a batch is sorted by length, so its first rows are its shortest), before that batch
trains: in a run's first epoch text it has not trained on. (One update moves a batch's walk by
0.6% on the demo, so before or after makes no measurable difference there.) One response's
acceptance varies by ~40% of the mean, so a walk of a few rows is noise; a record pools the last
walks that hold `train.est_tau_window` rows over the drafters (`pooled_walks`,
runtime/step_metrics.WalkHistory) and its est_tau is the training `tau` of the last
`train.est_tau_interval` steps (step_metrics.UniformHistory) scaled by their ratio of walked accepted drafts
to uniform ones on the walked rows (components/acceptance.calibrated_walk).

`validate` takes this drafter's validation batches of an evaluation step from its batch source,
where the stream put them (after the step's training micro-steps, data/stream.py), and sums their
walks over every row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dflash_ds.components.acceptance import WALK_SUMS, target_labels, walk_anchors, walk_sums
from dflash_ds.components.objective import TargetStates
from dflash_ds.config import Config

if TYPE_CHECKING:
    from dflash_ds.data.batching import Cursor
    from dflash_ds.data.stream import BatchStream
    from dflash_ds.runtime.sources import BatchSource

DEFAULT_MAX_BLOCKS = 2048  # blocks per forward when loss.max_anchors_per_batch is 0 (no cap)


def walks_at(cfg: Config, step: int) -> bool:
    """Whether step `step` (0-based) walks est_tau: every `train.est_tau_interval` steps, counted as records are
    (the step that completes `done = step + 1`), never with `train.est_tau_rows` 0. The same on every drafter."""
    return cfg.train.est_tau_rows > 0 and (step + 1) % cfg.train.est_tau_interval == 0


def pooled_walks(cfg: Config, num_drafters: int) -> int:
    """Walks a record's est_tau pools: the fewest whose rows over the drafters reach `train.est_tau_window`
    (e.g. 64 rows of 4 per drafter: 8 walks on 2 drafters, 2 on 8)."""
    per_walk = max(1, cfg.train.est_tau_rows * num_drafters)
    return max(1, -(-cfg.train.est_tau_window // per_walk))


def walk_rows(n: int, rows: int) -> list[int]:
    """`rows` row indices spread evenly over a batch of `n` (the middle of each of `rows` equal parts); 0 or
    rows >= n: all of them."""
    if rows <= 0 or rows >= n:
        return list(range(n))
    return [(2 * i + 1) * n // (2 * rows) for i in range(rows)]


def estimate(engine, tensors: dict, cfg: Config, dtype: torch.dtype, rows: int = 0) -> dict[str, float]:
    """Walk sums (components/acceptance.WALK_SUMS) of `rows` rows of a batch spread over it (0: all of them).

    Collective over the drafters (the forward count); `engine` is the DeepSpeed engine or the bare module.
    """
    n = tensors["input_ids"].shape[0]
    picked = walk_rows(n, rows)
    keep = slice(None) if len(picked) == n else picked  # every row: views, no copy
    last = tensors.get("last_hidden")
    module = getattr(engine, "module", engine)
    # a sequence-parallel rank fed by target ranks holds its shard: the walked rows are gathered whole
    width = tensors["input_ids"].shape[1]
    context = module.whole_context(tensors["context"][keep], width)
    # the walk reads the final hidden only for target labels (then gathered whole, as the context)
    last = module.whole_context(last[keep], width) if last is not None and cfg.loss.labels == "target" else None
    states = TargetStates(tensors["input_ids"][keep], tensors["loss_mask"][keep], tensors["lengths"][keep],
                          context.to(dtype), last)
    was_training = module.training
    module.eval()  # the drafter has no dropout; eval mode all the same, for anything that would
    try:
        with torch.no_grad():
            anchors, valid = walk_anchors(states.loss_mask, states.lengths)
            label_ids = states.input_ids
            if cfg.loss.labels == "target" and states.last_hidden is not None:
                chunk = cfg.loss.chunk_blocks * (module.drafter.arch.block_size - 1)
                label_ids = target_labels(states.input_ids, states.last_hidden.to(dtype), module.lm_head, chunk)
            per = max(1, (cfg.loss.max_anchors_per_batch or DEFAULT_MAX_BLOCKS) // anchors.shape[0])
            chunks = [slice(lo, lo + per) for lo in range(0, anchors.shape[1], per)]
            # The count is agreed before any forward: under ZeRO-3 every forward gathers parameters with the other
            # drafters, so a drafter with more chunks must not run them while another waits in the agreement.
            total = _agree_forwards(len(chunks))
            runs = [engine(states, cfg.loss, blocks=(anchors[:, c], valid[:, c], label_ids)) for c in chunks]
            for _ in range(total - len(chunks)):
                _idle_forward(engine, module, cfg, dtype, states.context.device)
    finally:
        module.train(was_training)
    runs = torch.cat(runs, dim=1)  # [R, A, 2]: as drafted, by the argmax (components/acceptance.accepted_runs)
    return walk_sums(runs[..., 0], anchors, valid, states.loss_mask, states.lengths, module.drafter.arch.block_size,
                     uniform_runs=runs[..., 1])


def _agree_forwards(mine: int) -> int:
    """The most forwards any drafter needs for its batch (one tiny all-reduce; a host tensor, as `step.agree`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    count = torch.tensor([float(mine)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count[0])


def _idle_forward(engine, module, cfg: Config, dtype: torch.dtype, device: torch.device) -> None:
    """One forward of a single padding block without context: keeps the drafters' forward counts equal."""
    arch = module.drafter.arch
    zeros = torch.zeros((1, 1), dtype=torch.long, device=device)
    context = torch.zeros((1, 1, len(arch.target_layer_ids) * arch.hidden_size), dtype=dtype, device=device)
    states = TargetStates(zeros, zeros, torch.ones(1, dtype=torch.long, device=device), context, None)
    engine(states, cfg.loss, blocks=(zeros, zeros.bool(), zeros))


def validate(engine, source: BatchSource, data: BatchStream, cfg: Config, dtype: torch.dtype, step: int,
             drafter: int, cursor: Cursor) -> dict[str, float]:
    """Walk sums over this drafter's validation batches of evaluation step `step` (every row of each)."""
    sums = dict.fromkeys(WALK_SUMS, 0.0)
    for ms in data.val_steps(step, cursor):
        batch = source.get()
        if batch.batch_id != ms.batch_id(drafter):
            raise RuntimeError(f"drafter {drafter} expected validation batch {ms.batch_id(drafter)} after step "
                               f"{step}, got {batch.batch_id}")
        got = estimate(engine, batch.tensors, cfg, dtype)
        source.release(batch.tensors)
        for key in WALK_SUMS:
            sums[key] += got[key]
    return sums
