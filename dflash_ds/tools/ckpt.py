"""`dflash-ds ckpt info DIR`: what a checkpoint holds and on how many drafter ranks it can resume.

DIR is a checkpoint folder (checkpoints/step_N), a run's checkpoints/ folder or the run folder
itself (its latest complete checkpoint). Reads JSON and lists files only: nothing is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_ds.errors import DFlashError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ckpt info DIR [--drafters N ...] [--json]`."""
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="step, data cursor, drafter count, global batch, ZeRO stage, dtype, and "
                                       "whether it resumes on a given drafter count",
                          description=__doc__.splitlines()[0])
    info.add_argument("dir", help="checkpoint folder (checkpoints/step_N), a checkpoints/ folder or a run folder")
    info.add_argument("--drafters", type=int, nargs="+", default=None, metavar="N",
                      help="drafter counts to check (default: every count that divides the global batch)")
    info.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the checkpoint's facts; exit 1 when a --drafters count asked for cannot resume it."""
    from dflash_ds.runtime.checkpoint import resolve_resume
    from dflash_ds.runtime.resume import checkpoint_info

    path = Path(args.dir)
    if not path.exists():
        raise DFlashError(f"{path} does not exist")
    if any(n < 1 for n in args.drafters or []):
        raise DFlashError(f"--drafters: counts must be >= 1, got {args.drafters}")
    found = resolve_resume(str(path), path) if path.is_dir() else None
    info = checkpoint_info(found or path, args.drafters)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    asked = args.drafters or []
    return 1 if any(info["resume_on_drafters"][str(n)].startswith("no") for n in asked) else 0


def format_info(info: dict) -> str:
    """The human-readable table of `ckpt info`."""
    cur = info["cursor"] or {}
    arch = info["drafter"]
    lines = [
        f"checkpoint      {info['path']}",
        f"step            {info['step']} of {info['max_steps']}",
        f"data cursor     epoch {cur.get('epoch')}, batch {cur.get('batch_index')}",
        f"drafter ranks   {info['num_drafters']}" + (" (colocated: each also ran the target; resumes either way)"
                                                     if info["colocated"] else ""),
        f"global batch    {info['global_batch']} micro-batches per step"
        + (f" ({info['micro_batches_per_drafter']} per drafter)" if info["micro_batches_per_drafter"] else ""),
        f"ZeRO stage      {info['zero_stage']}",
        f"dtype           {info['dtype']}",
        f"drafter         hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, block "
        f"{arch['block_size']}, vocab {arch['vocab_size']}, target layers {arch['target_layer_ids']}",
        f"shards          {info['shard_files']} files, {info['shard_bytes'] / 1e9:.3f} GB"
        + (" (universal conversion present)" if info["universal_converted"] else ""),
        f"manifest        {info['manifest']}",
        "resume on",
    ]
    lines += [f"  {n:>3} drafter rank(s): {v}" for n, v in info["resume_on_drafters"].items()]
    return "\n".join(lines)
