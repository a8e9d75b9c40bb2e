"""Where a run resumes and how: the checkpoint, the global batch, and whether its shards need resharding.

A checkpoint is written by D drafter ranks under ZeRO stage z with a global batch of G
micro-batches per step. It resumes on D' drafters when D' divides G:

- D' = D and the same stage: the shards load as they are (`ds/`);
- ZeRO-0 on both sides: every rank holds the whole model and optimizer, any D' loads `ds/`;
- ZeRO-1/2/3 on both sides with another D' (or another stage): the shards are converted once
  into DeepSpeed's universal format (`ds_universal/`, one folder per parameter with its fp32
  value and Adam moments) by DeepSpeed's own converter, and loaded with `load_universal`.

Conversion happens on load, not at save time: a save stays one sharded write (the common case,
every `save_interval` steps), and the conversion, which reads and rewrites every optimizer state,
is paid only by the run that changes the drafter count. Everything here is cheap JSON reading,
done on every rank before any process group or model, so a checkpoint that cannot be resumed
fails at once, naming both numbers; then the drafters agree on the leader's decision
(`agree_on_resume`, the one part that needs their group) before any engine is built.
"""

from __future__ import annotations

import json
import shutil
import time
from argparse import Namespace
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dflash_ds.config import Config
from dflash_ds.errors import DFlashError
from dflash_ds.runtime import checkpoint as ckpt
from dflash_ds.data.stream import check_global_batch

UNIVERSAL_TAG = "ds_universal"
UNIVERSAL_DONE = "UNIVERSAL_COMPLETE"


@dataclass(frozen=True)
class ResumePoint:
    """What this run starts from: no checkpoint (fresh), or a checkpoint and how its shards load."""

    path: Path | None
    global_batch: int
    mode: str  # "fresh", "direct" (the shards as written) or "universal" (resharded)
    saved_drafters: int = 0
    saved_stage: int = -1
    best: dict | None = None  # {"step", "val_est_tau"} a new checkpoints/best must beat (`best_so_far`)

    @property
    def tag(self) -> str:
        """The folder under the checkpoint that engine.load_checkpoint reads."""
        return UNIVERSAL_TAG if self.mode == "universal" else ckpt.DS_TAG


def run_zero_stage(cfg: Config) -> int:
    """The ZeRO stage this run's DeepSpeed JSON asks for."""
    from dflash_ds.runtime.engine import resolve_ds_config

    path = resolve_ds_config(cfg)
    try:
        ds = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{path}: unreadable DeepSpeed config ({exc})") from None
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def saved_facts(state: dict[str, Any]) -> tuple[int, int, int, str]:
    """(drafters, global batch, ZeRO stage, dtype) a checkpoint was written with.

    Checkpoints from before the global batch existed trained one micro-batch per drafter.
    """
    n_d = int(state.get("num_drafters", 1))
    train = state.get("config", {}).get("train", {})
    stage = int(state.get("zero_stage", train.get("zero_stage", 2)))
    return n_d, int(state.get("global_batch", n_d)), stage, str(state.get("dtype", train.get("dtype", "auto")))


def resume_mode(path: Path, saved_d: int, saved_stage: int, num_drafters: int, stage: int) -> str:
    """How shards written by (saved_d, saved_stage) load on (num_drafters, stage); an error if they cannot."""
    if saved_d == num_drafters and saved_stage == stage:
        return "direct"
    if saved_stage == 0 and stage == 0:
        return "direct"
    if saved_stage >= 1 and stage >= 1:
        return "universal"
    raise DFlashError(f"checkpoint {path} was written by {saved_d} drafter rank(s) with ZeRO-{saved_stage}; this "
                      f"run has {num_drafters} with ZeRO-{stage}: a ZeRO-0 checkpoint loads only under ZeRO-0 "
                      f"and a ZeRO-1/2/3 one only under ZeRO-1/2/3 (set --zero-stage {saved_stage})")


def choose_resume(cfg: Config, num_drafters: int, log=None, data_parallel: int | None = None) -> ResumePoint:
    """The resume decision from the config and the run folder alone (every rank can take it); `log(line)` is told
    of a checkpoint passed over (it fails its manifest). `num_drafters`: the ZeRO ranks (how the shards load);
    `data_parallel`: the batches a micro-step trains (the drafters over topology.sequence_parallel; default all)."""
    path = ckpt.resolve_resume(cfg.train.resume, cfg.train.output_dir, log)
    asked = cfg.train.global_batch
    dp = data_parallel or num_drafters
    if path is None:
        g = asked or dp
        check_global_batch(g, dp, where="config: train.global_batch: ")
        return ResumePoint(None, g, "fresh")
    state = ckpt.read_state(path)
    saved_d, saved_g, saved_stage, _ = saved_facts(state)
    if asked and asked != saved_g:
        raise DFlashError(f"checkpoint {path} trains a global batch of {saved_g} micro-batches per step; this run "
                          f"asks train.global_batch = {asked}: a run keeps its global batch (leave it unset "
                          f"to take the checkpoint's, or start a new run with --resume none)")
    check_global_batch(saved_g, dp, where=f"checkpoint {path} ({saved_d} drafter rank(s)): ")
    mode = resume_mode(path, saved_d, saved_stage, num_drafters, run_zero_stage(cfg))
    return ResumePoint(path, saved_g, mode, saved_d, saved_stage, best_so_far(state, cfg.train.output_dir))


def best_so_far(state: dict[str, Any], output_dir: str | Path) -> dict | None:
    """The best val_est_tau a resumed run must beat: the resumed checkpoint's record of it, or the figures of the
    checkpoint `checkpoints/best` names when higher (a resume from an older checkpoint keeps a later best)."""
    best = state.get("best")
    pointed = ckpt.find_best(output_dir)
    if pointed is not None:
        there = ckpt.read_state(pointed)
        value = (there.get("val") or {}).get("val_est_tau")
        if ckpt.improves(value, best):
            best = {"step": int(there["step"]), "val_est_tau": float(value)}
    return best


def check_resume_state(state: dict, arch, path: Path) -> None:
    """A checkpoint whose drafter shape, block size or target layers differ from the run -> clear error."""
    saved = state.get("arch", {})
    for key, value in ckpt.arch_record(arch).items():
        if key in saved and saved[key] != value:
            raise DFlashError(f"checkpoint {path} has {key} = {saved[key]} but this run has {value}")


def agree_on_resume(ctx, cfg: Config, mine: ResumePoint, arch, leader: bool) -> ResumePoint:
    """Every drafter resumes as the leader decided (checked against the run's shape), resharded if needed.

    The leader converts the shards to the universal format when the drafter count changed; the
    others wait on the store (the conversion reads every optimizer state: minutes at real scale,
    longer than a collective's timeout). Collective over the drafter group.
    """
    import torch.distributed as dist

    decision = [mine if leader else None]
    dist.broadcast_object_list(decision, src=0)
    point: ResumePoint = decision[0]
    if point.path is None:
        return point
    check_resume_state(ckpt.read_state(point.path), arch, point.path)  # cheap JSON, before any model
    if point.mode == "universal":
        key = f"dflash/universal/{point.path.name}"
        if leader:
            try:
                convert_to_universal(point.path, log=lambda msg: print(msg, flush=True))
            finally:
                ctx.store.set(key, "ok" if universal_ready(point.path) else "failed")
        else:
            ctx.store.wait([key], timedelta(seconds=cfg.train.startup_timeout_s))
            if ctx.store.get(key).decode() != "ok":
                raise DFlashError(f"checkpoint {point.path}: the leader could not reshard it (see rank 0's error)")
    return point


def universal_ready(path: Path) -> bool:
    """Whether the checkpoint already holds a finished universal conversion."""
    return (path / UNIVERSAL_TAG / UNIVERSAL_DONE).is_file()


def convert_to_universal(path: Path, log=print) -> float:
    """Convert `path/ds` into `path/ds_universal` with DeepSpeed's converter (once); seconds it took.

    Written into `.partial` and renamed, so an interrupted conversion is redone, never half-read.
    Serial (one worker): the converter's process pool would fork a process that runs threads.
    """
    if universal_ready(path):
        return 0.0
    from deepspeed.checkpoint import ds_to_universal

    t0 = time.perf_counter()
    final = path / UNIVERSAL_TAG
    partial = path / (UNIVERSAL_TAG + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    log(f"[dflash-ds] resharding {path}: converting its ZeRO shards to the universal format...")
    args = Namespace(input_folder=str(path / ckpt.DS_TAG), output_folder=str(partial), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        ds_to_universal.main(args)
    except Exception as exc:  # noqa: BLE001 - DeepSpeed asserts and raises many kinds
        shutil.rmtree(partial, ignore_errors=True)
        raise DFlashError(f"checkpoint {path}: conversion to the universal format failed "
                          f"({type(exc).__name__}: {exc})") from None
    (path / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; the tag is passed explicitly
    (partial / UNIVERSAL_DONE).write_text("ok\n")
    partial.rename(final)
    seconds = time.perf_counter() - t0
    log(f"[dflash-ds] resharding {path}: done in {seconds:.1f}s ({final})")
    return seconds


def manifest_status(path: Path) -> str:
    """`ckpt info`'s word on the checkpoint's files against its manifest (runtime/checkpoint_manifest.py)."""
    from dflash_ds.runtime.checkpoint_manifest import MANIFEST, check_manifest

    if not (path / MANIFEST).is_file():
        return "none (written before checkpoints had one)"
    problem = check_manifest(path)
    return "intact (every file's size and sampled digest)" if problem is None else f"FAILS: {problem}"


def checkpoint_info(path: Path, drafters: list[int] | None = None) -> dict[str, Any]:
    """What `dflash-ds ckpt info` prints: where the run is, how it was trained, where it can resume."""
    if not ckpt.is_complete(path):
        raise DFlashError(f"{path} is not a complete checkpoint (no {ckpt.COMPLETE} or {ckpt.STATE})")
    state = ckpt.read_state(path)
    n_d, g, stage, dtype = saved_facts(state)
    arch = state.get("arch", {})
    shards = sorted(p.name for p in (path / ckpt.DS_TAG).glob("*.pt"))
    size = sum(p.stat().st_size for p in (path / ckpt.DS_TAG).rglob("*") if p.is_file())
    counts = drafters or sorted({d for d in range(1, max(g, n_d) + 1) if g % d == 0} | {n_d})
    resumable = {}
    for d in counts:
        try:
            check_global_batch(g, d)
            mode = resume_mode(path, n_d, stage, d, stage)
            resumable[str(d)] = "yes (shards as written)" if mode == "direct" else "yes (resharded: universal)"
        except DFlashError as exc:
            resumable[str(d)] = f"no: {exc}"
    return {"path": str(path), "step": state.get("step"), "cursor": state.get("cursor"),
            "max_steps": state.get("config", {}).get("train", {}).get("max_steps"),
            "num_drafters": n_d, "colocated": bool(state.get("colocated", False)),
            "global_batch": g, "micro_batches_per_drafter": g // n_d if g % n_d == 0 else None,
            "zero_stage": stage, "dtype": dtype, "seed": state.get("seed"),
            "drafter": {k: arch.get(k) for k in ("hidden_size", "num_hidden_layers", "block_size", "vocab_size",
                                                 "target_layer_ids")},
            "shard_files": len(shards), "shard_bytes": size, "universal_converted": universal_ready(path),
            "manifest": manifest_status(path),
            "resume_on_drafters": resumable}
