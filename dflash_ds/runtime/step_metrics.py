"""What a drafter logs: one record per micro-batch, and named metric accumulators of its log window.

Every drafter adds its steps into the same named fields; `reduce` packs them in a fixed order
(identical on every rank), does one all_reduce, and unpacks: no metric is addressed by its
position in a vector. `StepLog` writes records/drafter{d}.jsonl and closes each window (the
leader's monitor writes the reduced record to metrics.jsonl and W&B).

est_tau is not a window sum: walks are few (`train.est_tau_rows` rows every `train.est_tau_interval`
steps, to keep their cost a few % of training) and one response's acceptance varies by ~40% of its mean,
so a record pools the last walks that hold `train.est_tau_window` rows over the drafters (`WalkHistory`).
Each walk is written to records/walks{d}.jsonl (with its seconds, `walk_s`), from which a resumed run
reads them back: its records carry the figures of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dflash_ds.components.acceptance import WALK_SUMS, calibrated_walk, walk_metrics
from dflash_ds.components.loss import ACCEPTANCE_SUMS, metrics_from_sums
from dflash_ds.models.kinds import kind_losses
from dflash_ds.runtime.memory import compiled_graphs, peak_memory_bytes, reserved_memory_bytes, reset_peak_memory
from dflash_ds.runtime.records import absent_drafters, keep_lineage

if TYPE_CHECKING:
    from dflash_ds.data.stream import BatchStream
    from dflash_ds.distributed.topology import RoleContext
    from dflash_ds.runtime.monitor import Monitor
    from dflash_ds.runtime.step import StepResult

# Sums of DFlash's loss statistics (components/loss.metric_sums and acceptance_sums + the objective's "anchors").
LOSS_SUMS = ("valid_positions", "correct", "top4", "top8", "blocks", "streak", "tree_streak4", "tree_streak8",
             "anchors", *ACCEPTANCE_SUMS)
# Per-step values summed over steps and drafters (divided by their count when logged).
STEP_SUMS = ("loss", "steps", "real_tokens", "padded_tokens", "num_seqs", "queue_depth", "tgt_batch_per_s",
             "tgt_forward_s", "grad_norm", "lr", "noise_std")
# Walk sums (components/acceptance.WALK_SUMS) of est_tau at the record and of the validation split.
WALK_KINDS = ("est", "val")
WALK_KEYS = tuple(f"{kind}_{key}" for kind in WALK_KINDS for key in WALK_SUMS)


def loss_sum_names() -> tuple[str, ...]:
    """LOSS_SUMS, then every registered kind's own (its loss module's SUMS, models/kinds.py): one order on every rank,
    whatever the kind (a step of another kind adds zeros there)."""
    return LOSS_SUMS + tuple(key for loss in kind_losses() for key in loss.SUMS)


def kind_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Every kind's own metrics of a window's sums (its loss module's `metrics`; {} from a kind without sums)."""
    return {key: value for loss in kind_losses() for key, value in loss.metrics(sums).items()}


@dataclass
class MetricWindow:
    """One drafter's sums since the last record. Vectors: per bucket, per block position, per drafter rank."""

    num_buckets: int
    num_positions: int
    num_drafters: int
    drafter: int
    # 1 / topology.sequence_parallel: the N ranks of a group trained one batch and walked the same rows, so each
    # adds 1/N of the batch (its count, loss, tokens, rates) and of its walks: the record's means and totals are
    # the batches', as without SP. The loss statistics are already this rank's blocks' own, added whole.
    share: float = 1.0
    sums: dict[str, float] = field(default_factory=dict)
    buckets: list[float] = field(default_factory=list)
    pos_correct: list[float] = field(default_factory=list)
    pos_valid: list[float] = field(default_factory=list)
    skipped_total: float = 0.0  # a running count over the whole run, not a window sum
    peak_mem_bytes: float = 0.0  # this rank's peak in the window

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Start a new window (the running skipped count is kept)."""
        self.loss_sums = loss_sum_names()
        self.sums = {k: 0.0 for k in STEP_SUMS + self.loss_sums + WALK_KEYS}
        self.buckets = [0.0] * self.num_buckets
        self.pos_correct = [0.0] * self.num_positions
        self.pos_valid = [0.0] * self.num_positions
        self.peak_mem_bytes = 0.0
        # The loss statistics stay on the step's device until the window closes: reading them per
        # micro-step (float(), tolist()) would make the host wait for the GPU a dozen times a step.
        self._device_sums: torch.Tensor | None = None

    @property
    def steps(self) -> float:
        """Micro-batches this drafter added since the last record (a share of one under sequence parallelism)."""
        return self.sums["steps"]

    def add_step(self, loss: float, loss_sums: dict[str, torch.Tensor], meta: dict, queue_depth: int,
                 grad_norm: float, lr: float, noise_std: float) -> None:
        """One micro-step's loss, statistics and batch facts."""
        s, w = self.sums, self.share
        s["loss"] += (loss if math.isfinite(loss) else 0.0) * w
        s["steps"] += w
        zero = torch.zeros_like(loss_sums["anchors"])  # another kind's statistics: this step has none
        stats = torch.cat([torch.stack([loss_sums.get(k, zero) for k in self.loss_sums]), loss_sums["pos_correct"],
                           loss_sums["pos_valid"]]).detach().double()  # one device vector, no host read
        self._device_sums = stats if self._device_sums is None else self._device_sums + stats
        for key in ("real_tokens", "padded_tokens", "num_seqs", "tgt_batch_per_s", "tgt_forward_s"):
            s[key] += float(meta[key]) * w
        s["queue_depth"] += queue_depth * w
        s["grad_norm"] += (grad_norm if math.isfinite(grad_norm) else 0.0) * w
        s["lr"] += lr * w
        s["noise_std"] += noise_std * w
        self.buckets[int(meta["bucket"])] += w

    def add_walk(self, kind: str, sums: dict[str, float] | None) -> None:
        """Walk sums of est_tau ("est", the pooled walks) or of the validation batches ("val"), on the host."""
        for key, value in (sums or {}).items():
            self.sums[f"{kind}_{key}"] += value * self.share

    def _read_device_sums(self) -> None:
        """Move the window's device statistics into the host sums (once per window: one host read)."""
        if self._device_sums is None:
            return
        v, n, k = self._device_sums.cpu().tolist(), len(self.loss_sums), self.num_positions
        for key, value in zip(self.loss_sums, v[:n]):
            self.sums[key] += value
        self.pos_correct = [a + b for a, b in zip(self.pos_correct, v[n:n + k])]
        self.pos_valid = [a + b for a, b in zip(self.pos_valid, v[n + k:n + 2 * k])]
        self._device_sums = None

    def _pack(self) -> list[float]:
        self._read_device_sums()
        peak = [0.0] * self.num_drafters
        peak[self.drafter] = self.peak_mem_bytes  # a sum of one-hot rows = every rank's value
        return ([self.sums[k] for k in STEP_SUMS + self.loss_sums + WALK_KEYS] + [self.skipped_total] + self.buckets
                + self.pos_correct + self.pos_valid + peak)

    def reduce(self, device: torch.device | None = None) -> "WindowTotals":
        """Sum every drafter's window in one all_reduce (collective over the drafter group)."""
        packed = torch.tensor(self._pack(), dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(packed)
        v = packed.cpu().tolist()
        names = STEP_SUMS + self.loss_sums + WALK_KEYS
        i = len(names)
        nb, k, d = self.num_buckets, self.num_positions, self.num_drafters
        return WindowTotals(sums=dict(zip(names, v[:i])), skipped_total=v[i], buckets=v[i + 1:i + 1 + nb],
                            pos_correct=v[i + 1 + nb:i + 1 + nb + k], pos_valid=v[i + 1 + nb + k:i + 1 + nb + 2 * k],
                            peak_mem_bytes=v[i + 1 + nb + 2 * k:i + 1 + nb + 2 * k + d])


def _lines_by_step(path: Path, start_step: int) -> dict[int, dict]:
    """A records file's lines up to `start_step`, by step (a later line for a step replaces an earlier one: a step
    redone after a resume)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else None
            if rec and rec["step"] <= start_step:
                out[int(rec["step"])] = rec
    return out


class WalkHistory:
    """One drafter's est_tau walks (walk sums by the step they completed with); a record pools the last `keep`."""

    def __init__(self, walks: dict[int, dict[str, float]] | None = None) -> None:
        self.walks = dict(walks or {})
        self.keep = 0  # walks a record pools, as the steps' results carry it (0: every walk)

    def add(self, done: int, sums: dict[str, float] | None, keep: int) -> None:
        """The walk of the step that completed `done` (None: no walk there); only the last `keep` are kept."""
        self.keep = keep
        if sums:
            self.walks[done] = {k: float(sums[k]) for k in WALK_SUMS}
        if keep:
            self.walks = {s: self.walks[s] for s in sorted(self.walks)[-keep:]}

    def pooled(self, done: int) -> dict[str, float] | None:
        """Sums of the last `keep` walks up to step `done`, or None without one."""
        steps = [s for s in sorted(self.walks) if s <= done]
        inside = [self.walks[s] for s in (steps[-self.keep:] if self.keep else steps)]
        return {k: sum(w[k] for w in inside) for k in WALK_SUMS} if inside else None

    @classmethod
    def read(cls, path: Path, start_step: int) -> "WalkHistory":
        """The walks a run resumed at `start_step` had made (path's lines up to that step; a later line for
        the same step replaces an earlier one: a step redone after a resume walks the same weights)."""
        return cls({step: {k: float(rec[k]) for k in WALK_SUMS}
                    for step, rec in _lines_by_step(path, start_step).items()})


class UniformHistory:
    """The uniform argmax streak sums (streak, blocks: over every drafter) of each record window, by the step that
    closed it; `tau` is the training tau est_tau scales to: every block trained in the last `interval` steps.

    One record's window (train.log_interval steps) is short, and the length buckets put rows alike side by side:
    on the quality target, whose tasks differ in length, one record's tau read 4.3 to 5.9 over three seeds whose
    served tau was 3.1-3.6. The history is written to records/uniform{d}.jsonl and read back on a resume."""

    def __init__(self, windows: dict[int, tuple[float, float]] | None = None) -> None:
        self.windows = dict(windows or {})

    def add(self, done: int, streak: float, blocks: float, interval: int) -> None:
        """The window closed at step `done`; windows older than `interval` steps before it are dropped."""
        self.windows[done] = (float(streak), float(blocks))
        self.windows = {s: w for s, w in self.windows.items() if s > done - interval}

    def tau(self, done: int, interval: int) -> float | None:
        """1 + the mean streak over the windows closed in (done - interval, done]; None without a block."""
        inside = [w for s, w in self.windows.items() if done - interval < s <= done]
        blocks = sum(b for _, b in inside)
        return 1.0 + sum(st for st, _ in inside) / blocks if blocks > 0 else None

    @classmethod
    def read(cls, path: Path, start_step: int) -> "UniformHistory":
        """The windows a run resumed at `start_step` had closed (a later line for a step replaces an earlier one)."""
        return cls({step: (float(rec["streak"]), float(rec["blocks"]))
                    for step, rec in _lines_by_step(path, start_step).items()})


@dataclass
class WindowTotals:
    """A log window summed over the drafters."""

    sums: dict[str, float]
    skipped_total: float
    buckets: list[float]
    pos_correct: list[float]
    pos_valid: list[float]
    peak_mem_bytes: list[float]  # per drafter rank
    est_base_tau: float | None = None  # the training tau est_tau scales to (UniformHistory.tau), set by StepLog

    def loss_metrics(self) -> dict:
        """The window's loss statistics over every drafter (components/loss.metrics_from_sums)."""
        return metrics_from_sums({**{k: torch.tensor(self.sums[k]) for k in LOSS_SUMS},
                                  "pos_correct": torch.tensor(self.pos_correct), "pos_valid": torch.tensor(self.pos_valid)})

    def walks(self, tau: float | None = None) -> dict[str, float]:
        """est_tau, est_tau_pooled, est_tau_walked (the pooled walks scaled to the training `tau` of the last
        train.est_tau_interval steps, `est_base_tau`, else of this window: acceptance.calibrated_walk) and, after
        an evaluation, val_est_tau, val_est_tau_pooled and val_tau (every validation row walked by the drafter as
        it is: no scaling)."""
        if tau is None:
            tau = self.est_base_tau if self.est_base_tau is not None else float(self.loss_metrics()["tau"])
        sums = {kind: {k: self.sums[f"{kind}_{k}"] for k in WALK_SUMS} for kind in WALK_KINDS}
        return {**calibrated_walk(sums["est"], tau), **walk_metrics(sums["val"], "val_")}

    def record(self, step: int, epoch: int, window_s: float, global_batch: int, num_drafters: int, num_targets: int,
               max_steps: int, sec_per_step: float) -> dict:
        """One metrics.jsonl record (a step trains `global_batch` micro-batches over the drafters)."""
        s = self.sums
        n = s["steps"]  # micro-batches in the window, over all drafters
        steps = n / global_batch
        m = self.loss_metrics()
        real, padded = s["real_tokens"], s["padded_tokens"]
        peaks_gb = [round(b / 1024 ** 3, 4) for b in self.peak_mem_bytes]
        return {
            "step": step, "epoch": epoch, "loss": s["loss"] / n, **{key: m[key] for key in (
                "accuracy", "avg_streak", "tau", "top4_accuracy", "top8_accuracy", "tree_streak4", "tree_streak8")},
            "accuracy_per_position": m["accuracy_per_position"],
            # mean sum_v min(p_drafter, p_target) over label positions: only when the loss read the target's
            # distribution (loss.kl_weight > 0, loss.lk or loss.labels = target); alpha_tau: 1 + the expected
            # accepted drafts of a block under speculative sampling (sum_k prod_{j<=k} alpha_j), uniform anchors;
            # argmax_alpha(_tau): the same for the drafter's argmax drafted (vLLM's and SGLang's default)
            **({k: m[k] for k in ("alpha", "tv_distance", "alpha_tau", "argmax_alpha", "argmax_alpha_tau")}
               if "alpha" in m else {}),
            # the kind's own metrics (its loss module's `metrics`: models/kinds.py KindSpec.loss_module), e.g. a
            # candidate selector's accuracy and term, a confidence head's calibration and term
            **kind_metrics(s),
            # greedy decoding walked over the response (components/acceptance.py): est_tau at every record when
            # train.est_tau_rows > 0, val_* on the validation split at an evaluation step
            **self.walks(self.est_base_tau if self.est_base_tau is not None else float(m["tau"])),
            **({"est_tau_base": self.est_base_tau}
               if self.est_base_tau is not None and s["est_responses"] > 0 else {}),
            "lr": s["lr"] / n, "noise_std": s["noise_std"] / n, "grad_norm": s["grad_norm"] / n,
            # each header carries its target's own rate: the mean times T is the whole target side's
            "tgt_batch_per_sec": s["tgt_batch_per_s"] / n * num_targets,
            # micro-steps whose loss was not finite (each drafter counts the same, agreed ones): whole
            # skipped updates without accumulation, micro-batches dropped from their update with it
            "skipped_steps": self.skipped_total / num_drafters,
            "dft_batch_per_sec": n / window_s, "tok_per_sec": real / window_s,
            "hs_queue_depth": s["queue_depth"] / n, "tgt_forward_s": s["tgt_forward_s"] / n,
            "avg_seq_len": real / max(s["num_seqs"], 1), "padding_efficiency": real / max(padded, 1),
            "bucket_pct": {str(b): c / n for b, c in enumerate(self.buckets)},
            "real_tokens": real, "padded_tokens": padded,
            # per optimizer step, summed over the drafters (what one step trained on)
            "anchors": s["anchors"] / steps, "label_positions": s["valid_positions"] / steps,
            # each drafter rank's peak in the window: CUDA max_memory_allocated, or peak RSS on CPU
            "peak_mem_gb": max(peaks_gb), "peak_mem_gb_per_rank": peaks_gb,
            "eta_s": sec_per_step * (max_steps - step), "step_time_s": window_s / max(steps, 1),
        }


class StepLog:
    """A drafter's per-micro-batch records (records/drafter{d}.jsonl) and its metric window.

    Made once the batch source is up: the first window's time and peak memory start here.
    """

    def __init__(self, out: Path, ctx: RoleContext, data: BatchStream, block_size: int, max_steps: int,
                 start_step: int, monitor: Monitor | None, est_tau_interval: int = 1) -> None:
        layout, d = ctx.layout, ctx.role_rank
        records = out / "records"
        records.mkdir(parents=True, exist_ok=True)
        # One lineage: the steps an interrupted run recorded past the checkpoint are trained again from here.
        keep_lineage(records, start_step, [d, *(absent_drafters(records, layout.num_drafters) if d == 0 else [])])
        self.file = (records / f"drafter{d}.jsonl").open("a")
        self.walks = WalkHistory.read(records / f"walks{d}.jsonl", start_step)
        self.walk_file = (records / f"walks{d}.jsonl").open("a")
        self.uniform = UniformHistory.read(records / f"uniform{d}.jsonl", start_step)
        self.uniform_file = (records / f"uniform{d}.jsonl").open("a")
        self.est_tau_interval = max(1, est_tau_interval)
        self.window = MetricWindow(len(data.boundaries), block_size - 1, layout.num_drafters, d,
                                   share=1.0 / layout.sequence_parallel)
        self.device, self.monitor, self.max_steps, self.start_step = ctx.device, monitor, max_steps, start_step
        self.global_batch, self.num_drafters = data.global_batch, layout.num_drafters
        # colocated: every rank ran a target, the N ranks of a sequence-parallel group on the same batch
        self.num_targets = layout.num_targets or layout.data_parallel
        reset_peak_memory(ctx.device)
        self.t_last = self.run_start = time.perf_counter()

    def add(self, step: int, result: StepResult) -> None:
        """One optimizer step: a record per micro-batch (flushed), each micro-batch added to the window."""
        for r in result.micro:
            if r.skipped:
                self.window.skipped_total += 1
            self.file.write(json.dumps({"step": step, "micro": r.micro, "batch_id": r.batch_id,
                                        "bucket": int(r.meta["bucket"]), "epoch_after": int(r.meta["epoch_after"]),
                                        "loss": r.loss, "skipped": r.skipped,
                                        "target_rank": int(r.meta["target_rank"])}) + "\n")
            self.window.add_step(r.loss, r.sums, r.meta, r.depth, result.grad_norm, result.lr, result.noise)
        self.file.flush()
        self.walks.add(step + 1, result.est, result.est_walks)
        if result.est:
            self.walk_file.write(json.dumps({"step": step + 1, **result.est}) + "\n")
            self.walk_file.flush()

    def close_window(self, done: int, epoch: int) -> WindowTotals:
        """Reduce the window over the drafters (collective); the leader logs it as step `done`; start the next.

        Returns the totals, the same on every drafter (what they decide on together, e.g. a best checkpoint)."""
        self.window.peak_mem_bytes = peak_memory_bytes(self.device)
        self.window.add_walk("est", self.walks.pooled(done))  # every drafter walks the same steps
        totals = self.window.reduce()  # host tensors: the role group carries them on GPU too (cpu:gloo)
        streak, blocks = totals.sums["streak"], totals.sums["blocks"]
        self.uniform.add(done, streak, blocks, self.est_tau_interval)
        self.uniform_file.write(json.dumps({"step": done, "streak": streak, "blocks": blocks}) + "\n")
        self.uniform_file.flush()
        totals.est_base_tau = self.uniform.tau(done, self.est_tau_interval)
        now = time.perf_counter()
        if self.monitor is not None:
            record = totals.record(done, epoch, now - self.t_last, self.global_batch, self.num_drafters,
                                   self.num_targets, self.max_steps, (now - self.run_start) / max(done - self.start_step, 1))
            reserved = reserved_memory_bytes(self.device)  # the leader's caching allocator (CUDA only)
            if reserved is not None:
                record["reserved_mem_gb"] = round(reserved / 1024 ** 3, 4)
            record["compiled_graphs"] = compiled_graphs()  # the leader's process
            self.monitor.log(record)
        self.window.clear()
        reset_peak_memory(self.device)
        self.t_last = now
        return totals

    def close(self) -> None:
        """Close the records files and the leader's monitor."""
        self.file.close()
        self.walk_file.close()
        self.uniform_file.close()
        if self.monitor is not None:
            self.monitor.close()
