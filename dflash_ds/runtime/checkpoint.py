"""Checkpoints: DeepSpeed shards + trainer state + HF export, written atomically.

Layout under OUTPUT_DIR/checkpoints/:
    step_00000010/            a complete checkpoint
        ds/                   engine.save_checkpoint (sharded over drafter ranks)
        trainer_state.json    step, data cursor, config, drafter shape
        export/               HF export of the drafter (docs/DESIGN.md §2)
        MANIFEST.json         each file's size and sampled digest, checked before a resume (checkpoint_manifest.py)
        COMPLETE              written last, before the rename (every file fsynced first)
    step_00000020.partial/    a save in progress (ignored and removed on the next start)
    latest                    name of the newest complete checkpoint, replaced atomically
    best                      name of the checkpoint with the best val_est_tau so far (with a validation split)

A save goes into `.partial`, every drafter rank finishes its shards, then rank 0 writes the
state and the export, marks it COMPLETE, renames it and only then moves `best` (when it is a
new best) and `latest`. A crash at any point leaves both on complete checkpoints. Keep-K rotation
(`train.keep_last`) never removes the one `best` names; its trainer_state.json holds its
validation figures ("val"), and every checkpoint's holds the best so far ("best": step and
val_est_tau), which a resumed run must beat (runtime/resume.py).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash_ds.config import Config, to_dict
from dflash_ds.data.batching import Cursor
from dflash_ds.errors import DFlashError
from dflash_ds.runtime import faults
from dflash_ds.runtime.checkpoint_manifest import (check_manifest, fsync_path, sync_tree, write_manifest,
                                                    write_synced)
from dflash_ds.runtime.monitor import scrub_secrets

LATEST = "latest"
BEST = "best"
COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
DS_TAG = "ds"


def checkpoint_root(output_dir: str | Path) -> Path:
    """OUTPUT_DIR/checkpoints."""
    return Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    """Folder of the checkpoint taken after `step` completed steps."""
    return root / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint folder that finished saving."""
    return (path / COMPLETE).is_file() and (path / STATE).is_file()


def find_latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the `latest` pointer, else the highest complete step folder."""
    root = checkpoint_root(output_dir)
    pointer = root / LATEST
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if is_complete(cand):
            return cand
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")
                      and is_complete(p))
    return complete[-1] if complete else None


def newest_intact(output_dir: str | Path, log=None) -> Path | None:
    """The newest complete checkpoint that matches its manifest (runtime/checkpoint_manifest.py): the one
    `latest` names first, then the complete step folders newest first; `log(line)` is told of each one passed
    over and why."""
    root = checkpoint_root(output_dir)
    complete = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")
                       and is_complete(p)), reverse=True)
    first = find_latest(output_dir)
    for cand in ([first] if first is not None else []) + [p for p in complete if p != first]:
        problem = check_manifest(cand) or _unreadable_state(cand)
        if problem is None:
            return cand
        if log is not None:
            log(f"[dflash-ds] checkpoint {cand} fails its manifest: {problem}; passed over for the previous "
                f"complete checkpoint (remove or move that folder to silence this)")
    return None


def _unreadable_state(path: Path) -> str | None:
    try:
        json.loads((path / STATE).read_text())
    except (OSError, ValueError) as exc:
        return f"{path / STATE} is unreadable ({type(exc).__name__}: {exc})"
    return None


def find_best(output_dir: str | Path) -> Path | None:
    """The complete checkpoint `checkpoints/best` names, or None."""
    root = checkpoint_root(output_dir)
    pointer = root / BEST
    if not pointer.is_file():
        return None
    cand = root / pointer.read_text().strip()
    return cand if is_complete(cand) else None


def improves(value: float | None, best: dict | None) -> bool:
    """Whether a val_est_tau beats the best so far ({"step", "val_est_tau"} or None); NaN never does."""
    if value is None or not math.isfinite(value):
        return False
    return best is None or value > float(best["val_est_tau"])


def forget_best(output_dir: str | Path) -> None:
    """A fresh run (no resume) drops the `best` pointer of an earlier run in the same folder: its step folders
    are about to be rewritten, so the name would come to mean other weights."""
    (checkpoint_root(output_dir) / BEST).unlink(missing_ok=True)


def resolve_resume(resume: str, output_dir: str | Path, log=None) -> Path | None:
    """--resume auto|none|PATH -> checkpoint folder or None (errors name the path). auto: the newest complete
    checkpoint that matches its manifest (`log` is told of any passed over); PATH: an error if it does not."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_intact(output_dir, log)
    path = Path(resume)
    if is_complete(path):  # a checkpoint folder (DeepSpeed writes a `latest` of its own inside it)
        pass
    elif path.is_dir() and (path / LATEST).is_file():  # a checkpoints/ root was given
        path = path / (path / LATEST).read_text().strip()
    elif path.is_dir() and (path / "checkpoints").is_dir():
        found = find_latest(path)
        if found is None:
            raise DFlashError(f"--resume {resume}: no complete checkpoint under {path / 'checkpoints'}")
        path = found
    if not is_complete(path):
        raise DFlashError(f"--resume {resume}: {path} is not a complete checkpoint (no {COMPLETE} or {STATE})")
    problem = check_manifest(path)
    if problem is not None:
        raise DFlashError(f"--resume {resume}: {path} fails its manifest: {problem}; resume from an earlier "
                          f"checkpoint (--resume auto takes the newest intact one)")
    return path


def read_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint (plain JSON: nothing is unpickled)."""
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{path / STATE}: unreadable trainer state ({exc})") from None


def _deepspeed_safe_globals() -> list:
    # The only non-tensor objects DeepSpeed 0.19 puts in ZeRO 0-3 shards (loss scaler, stage
    # enum, bf16 slice map); allow-listing these classes lets them be rebuilt without pickle's
    # arbitrary callables.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str | Path, map_location: Any = None) -> Any:
    """torch.load(weights_only=True) of a DeepSpeed shard: tensors and DeepSpeed's few types, nothing else."""
    import torch

    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))  # torch's multi-line message names the offending global
        what = f"it holds {found.group(1)}, which" if found else "it holds an object that"
        raise DFlashError(f"checkpoint shard {path}: refused to unpickle: {what} a weights-only load does not "
                          f"allow; resume only from checkpoints this trainer wrote") from None


def use_safe_loading(engine) -> None:
    """Make engine.load_checkpoint read shards with weights_only=True (DeepSpeed passes weights_only=False)."""
    engine.checkpoint_engine.load = safe_torch_load


def clean_partials(output_dir: str | Path) -> list[Path]:
    """Remove leftovers of interrupted saves (rank 0, before training starts)."""
    root = checkpoint_root(output_dir)
    removed = []
    for p in root.glob("*.partial"):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def check_writable(output_dir: str | Path) -> None:
    """Fail early with a clear message when the run folder cannot be written."""
    root = checkpoint_root(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DFlashError(f"output folder {output_dir} is not writable ({exc.strerror})") from None


def save_checkpoint(engine, step: int, output_dir: str | Path, state: dict[str, Any], keep_last: int,
                    export_fn, best: bool = False) -> Path:
    """Collective over the drafter group. `export_fn(folder)` writes the HF export (rank 0 writes).

    `best`: this checkpoint becomes `checkpoints/best` (moved after the rename, before `latest`)."""
    root = checkpoint_root(output_dir)
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        engine.save_checkpoint(str(partial), tag=DS_TAG, client_state=universal_info())
        faults.in_save(step)
        export_fn(partial / "export")  # gathers under ZeRO-3: every rank calls it
        sync_tree(partial)  # what this host wrote there is on the disk before anything calls it complete
        dist.barrier()  # every rank's shards are on disk
        if rank == 0:
            write_synced(partial / STATE, json.dumps(state, indent=2) + "\n")
            write_manifest(partial, skip=(COMPLETE, STATE))  # the state is JSON a user may edit: parsed instead
            write_synced(partial / COMPLETE, f"{step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            fsync_path(root)
            for pointer in ((BEST,) if best else ()) + (LATEST,):
                tmp = root / (pointer + ".tmp")
                tmp.write_text(final.name + "\n")
                os.replace(tmp, root / pointer)
            _prune(root, keep_last)
        dist.barrier()
    except OSError as exc:
        raise DFlashError(f"checkpoint at step {step} failed: {exc.strerror or exc} ({partial}); "
                          f"the previous checkpoint is intact") from None
    return final


# The drafter's shape as a checkpoint records it; a resume must match every one (runtime/resume.py).
# Checkpoints written before the head and MLP widths were recorded lack those keys: not checked there.
SHAPE_KEYS = ("block_size", "target_layer_ids", "num_hidden_layers", "hidden_size", "vocab_size", "mask_token_id",
              "layer_types", "sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "kind")


def arch_record(arch) -> dict[str, Any]:
    """The drafter's shape as a checkpoint records it: SHAPE_KEYS, then `<kind>_options` of every registered kind
    with options (that kind's options as a dict on a drafter of it, None on another: the key names the kind, as
    checkpoints written before the kind registry do)."""
    from dflash_ds.models.kinds import kind_specs, options_dict

    record = {key: getattr(arch, key) for key in SHAPE_KEYS}
    for spec in kind_specs():
        if spec.options is not None:
            record[f"{spec.name}_options"] = options_dict(arch.options) if arch.kind == spec.name else None
    return record


def trainer_state(cfg: Config, arch, num_drafters: int, global_batch: int, zero_stage: int, dtype, step: int,
                  cursor: Cursor, val: dict | None = None, best: dict | None = None) -> dict[str, Any]:
    """trainer_state.json: where the run is, how it trains (resharding reads this) and the drafter shape;
    with a validation split, this step's figures (`val`, when it evaluated) and the best so far (`best`)."""
    extra = {**({"val": val} if val else {}), **({"best": best} if best else {})}
    return {"step": step, "cursor": asdict(cursor), "seed": cfg.train.seed, "num_drafters": num_drafters, **extra,
            # informational: a colocated checkpoint resumes disaggregated on the same drafter count, and back
            "colocated": bool(cfg.topology.colocate),
            "global_batch": global_batch, "zero_stage": zero_stage,
            "dtype": str(dtype).removeprefix("torch."),
            "arch": arch_record(arch),
            "rng": "per-batch generators seeded by (seed, global batch id): nothing else to restore",
            "config": scrub_secrets(to_dict(cfg))}


def universal_info() -> dict[str, Any]:
    """The client state DeepSpeed's universal converter requires in a checkpoint (runtime/resume.py)."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def _prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` step folders, and the one `best` names."""
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
    best = (root / BEST).read_text().strip() if (root / BEST).is_file() else None
    for old in complete[:-keep_last]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)
