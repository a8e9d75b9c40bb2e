"""The batch stream every rank walks: the prepared dataset cut into optimizer steps and micro-steps.

The stream is a pure function of (dataset, seed, token budget, buckets, global batch), identical on
every rank, so a target knows which batches a drafter will ask for and a resume continues exactly.

A validation split (data.val_fraction: rows drawn by seed and left out of the training batches, or
data.val_path: another prepared folder appended to the dataset) is a fixed list of batches. At an
evaluation step (train.eval_interval) the stream carries them after the step's training micro-steps,
as validation micro-steps that every rank walks like the others: targets compute them, drafters
evaluate them. Their batch ids are negative (never a training id) and still name their drafter
(id mod D).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dflash_ds.config import Config
from dflash_ds.data.batching import BatchSampler, BatchSpec, Cursor, bucket_boundaries, build_epoch
from dflash_ds.data.loader import COLUMNS, collate, load_lengths
from dflash_ds.errors import DFlashError

VAL_SALT = 0x7A1  # the validation rows' draw, apart from every other use of the seed


@dataclass(frozen=True)
class MicroStep:
    """One micro-step of the stream: micro-batch `micro` of optimizer step `step`, one batch per drafter.

    `index` = step * A + micro (A = micro-batches per drafter per step) numbers the micro-steps;
    drafter d's batch of it is global batch index * D + d = step * G + micro * D + d, so with
    A = 1 this is the one-batch-per-drafter rule of `Layout.route`, and the G batches of
    a step are the same whatever D is.
    """

    step: int
    micro: int
    index: int
    specs: list[BatchSpec]
    after: Cursor  # the data cursor once the whole optimizer step is done
    val: bool = False  # a validation micro-step (evaluated after the step's training micro-steps)

    def batch_id(self, drafter_idx: int) -> int:
        """The global batch id of drafter `drafter_idx`'s batch in this micro-step."""
        return self.index * len(self.specs) + drafter_idx


@dataclass
class BatchStream:
    """The prepared dataset and its batch stream, identical on every rank.

    The stream is cut into optimizer steps of `global_batch` batches (G); each of the D drafters
    accumulates A = G / D of them per step. The sampler groups by G, not D, so the same seed gives
    the same step-by-step batches on any drafter count that divides G.
    """

    dataset: object  # datasets.Dataset, memory-mapped
    lengths: np.ndarray
    boundaries: list[int]
    num_drafters: int
    seed: int
    token_budget: int
    global_batch: int = 0  # 0: one batch per drafter (G = D)
    rows: np.ndarray | None = None  # the dataset row of each entry of `lengths` (None: row i is entry i)
    val_specs: tuple[BatchSpec, ...] = ()  # the validation batches (sample ids are dataset rows)
    eval_interval: int = 0  # steps between evaluations (0: never)

    def __post_init__(self) -> None:
        self.global_batch = self.global_batch or self.num_drafters
        check_global_batch(self.global_batch, self.num_drafters)

    @property
    def val_micro_steps(self) -> int:
        """Validation micro-steps per evaluation: every drafter takes this many validation batches."""
        return -(-len(self.val_specs) // self.num_drafters) if self.eval_interval else 0

    def is_eval_step(self, step: int) -> bool:
        """Whether optimizer step `step` ends with an evaluation (after it, `step + 1` steps are done)."""
        return self.val_micro_steps > 0 and (step + 1) % self.eval_interval == 0

    def val_steps(self, step: int, after: Cursor) -> Iterator[MicroStep]:
        """The validation micro-steps of evaluation step `step`: index -(1 + k), k counting them over the run.

        Drafter d's batch j is validation batch (j * D + d) mod n: with n not a multiple of D a few
        are evaluated twice, so that every drafter runs the same number of forwards (ZeRO-3 lockstep).
        """
        n_d, v, n = self.num_drafters, self.val_micro_steps, len(self.val_specs)
        first = ((step + 1) // self.eval_interval - 1) * v
        for j in range(v):
            specs = [self.val_specs[(j * n_d + d) % n] for d in range(n_d)]
            yield MicroStep(step, self.accumulation + j, -(1 + first + j), specs, after, val=True)

    @property
    def accumulation(self) -> int:
        """Micro-batches each drafter accumulates per optimizer step (A = G / D)."""
        return self.global_batch // self.num_drafters

    def sampler(self, consumer: int = 0) -> BatchSampler:
        """The global stream seen by consumer `consumer` of G (global batch g of an epoch -> g % G)."""
        return BatchSampler(self.lengths, self.token_budget, self.boundaries, self.seed,
                            dp_rank=consumer, dp_size=self.global_batch)

    def steps(self, cursor: Cursor) -> Iterator[tuple[Cursor, list[BatchSpec]]]:
        """Per optimizer step from `cursor`: (cursor after the step, its G batches)."""
        # One sampler builds each epoch once; index k of a step is its k-th micro-batch.
        steps = self.sampler(0).iterate_steps(cursor)
        if self.rows is None:
            return steps
        return ((after, [_on_rows(spec, self.rows) for spec in specs]) for after, specs in steps)

    def micro_steps(self, start_step: int, cursor: Cursor, stop_step: int) -> Iterator[MicroStep]:
        """Every micro-step of optimizer steps start_step..stop_step-1, in order (targets and drafters walk it)."""
        a, n_d = self.accumulation, self.num_drafters
        for step, (after, specs) in zip(range(start_step, stop_step), self.steps(cursor)):
            for m in range(a):
                yield MicroStep(step, m, step * a + m, specs[m * n_d:(m + 1) * n_d], after)
            if self.is_eval_step(step):
                yield from self.val_steps(step, after)

    def step_of_batch(self, batch_id: int) -> int:
        """The optimizer step a global batch id belongs to."""
        return batch_id // self.global_batch


def _on_rows(spec: BatchSpec, rows: np.ndarray) -> BatchSpec:
    """`spec` with its sample ids (entries of a subset's lengths) turned into dataset rows."""
    return dataclasses.replace(spec, sample_ids=rows[spec.sample_ids].tolist())


def check_global_batch(global_batch: int, num_drafters: int, where: str = "") -> None:
    """G must split evenly over the D drafters; the error names both numbers and the counts that work."""
    if global_batch % num_drafters:
        fits = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise DFlashError(f"{where}global batch {global_batch} cannot be split over {num_drafters} drafter ranks "
                          f"(train.global_batch must be a multiple of the drafter count; drafter counts that "
                          f"divide {global_batch}: {', '.join(map(str, fits))})")


def open_data(cfg: Config, num_drafters: int, vocab_size: int, global_batch: int | None = None) -> BatchStream:
    """Load the prepared dataset (memory-mapped) and check it fits the run; errors name the folder.

    With a validation split the stream's dataset holds every row (data.val_path's appended after the
    training folder's) and the training batches are cut from the training rows alone.
    """
    ds, lengths = _load_prepared(Path(cfg.data.path), cfg, vocab_size)
    boundaries = bucket_boundaries(cfg.data.max_length, cfg.data.num_buckets)
    g = cfg.train.global_batch if global_batch is None else global_batch
    rows, val_rows = None, np.zeros(0, dtype=np.int64)
    if cfg.data.val_fraction > 0:
        rows, val_rows = split_rows(len(lengths), cfg.data.val_fraction, cfg.train.seed, cfg.data.path)
    elif cfg.data.val_path:
        from datasets import concatenate_datasets

        val_ds, val_lengths = _load_prepared(Path(cfg.data.val_path), cfg, vocab_size)
        val_rows = np.arange(len(lengths), len(lengths) + len(val_lengths))
        ds = concatenate_datasets([ds.select_columns(list(COLUMNS)), val_ds.select_columns(list(COLUMNS))])
        lengths = np.concatenate([lengths, val_lengths])
        rows = np.arange(len(lengths) - len(val_lengths))
    val_specs: tuple[BatchSpec, ...] = ()
    if len(val_rows):
        val = build_epoch(lengths[val_rows], cfg.data.token_budget, boundaries, cfg.train.seed, 0)
        keep = val[:cfg.train.eval_batches] if cfg.train.eval_batches else val
        val_specs = tuple(_on_rows(spec, val_rows) for spec in keep)
    train_lengths = lengths if rows is None else lengths[rows]
    return BatchStream(ds, train_lengths, boundaries, num_drafters, cfg.train.seed, cfg.data.token_budget, g,
                       rows=rows, val_specs=val_specs, eval_interval=cfg.train.eval_interval)


def split_rows(n: int, fraction: float, seed: int, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows) of n: round(fraction * n) rows, at least one, drawn by seed; both ascending."""
    n_val = max(1, round(fraction * n))
    if n_val >= n:
        raise DFlashError(f"data folder {where}: data.val_fraction = {fraction} of {n} rows leaves none to train on")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng([seed, VAL_SALT]).choice(n, n_val, replace=False)] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def _load_prepared(path: Path, cfg: Config, vocab_size: int):
    """(dataset, lengths) of a prepared folder, checked against the run."""
    from datasets import load_from_disk

    if not path.is_dir():
        raise DFlashError(f"data folder {path} does not exist (run `dflash-ds prepare` first)")
    empty = f"data folder {path} holds no rows (were all rows dropped by prepare?)"
    if _saved_without_rows(path):  # datasets itself fails on it with an IndexError
        raise DFlashError(empty)
    try:
        ds = load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds
        raise DFlashError(f"data folder {path} is not a prepared dataset ({exc})") from None
    missing = {"input_ids", "loss_mask", "length"} - set(ds.column_names)
    if missing:
        raise DFlashError(f"data folder {path}: missing columns {sorted(missing)}")
    if len(ds) == 0:
        raise DFlashError(empty)
    lengths = load_lengths(ds)
    too_long = int((lengths > cfg.data.max_length).sum())
    if too_long:
        raise DFlashError(f"data folder {path}: {too_long} rows are longer than data.max_length = "
                          f"{cfg.data.max_length}; prepare with --max-length {cfg.data.max_length}")
    import pyarrow.compute as pc

    top = pc.max(pc.list_flatten(ds.data.column("input_ids"))).as_py()
    if top is not None and top >= vocab_size:
        raise DFlashError(f"data folder {path}: token id {top} >= the target vocabulary size {vocab_size} "
                          f"(prepared with another tokenizer?)")
    return ds, lengths


def _saved_without_rows(path: Path) -> bool:
    # save_to_disk of a 0-row dataset writes a state.json listing no Arrow files.
    try:
        return json.loads((path / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def load_batch(dataset, spec: BatchSpec, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors of one batch, read from the memory-mapped dataset (no prefetch)."""
    rows = dataset.select_columns(list(COLUMNS)).with_format(None)[spec.sample_ids]
    input_ids, loss_mask, attention_mask, lengths = collate(rows, spec, pad_id)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask, "lengths": lengths}
