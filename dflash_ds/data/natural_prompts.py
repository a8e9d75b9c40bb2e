"""`dflash-ds make-prompts`: the natural prompt grid (data/prompt_grid.py) split by topic into train/held-out JSONL."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from dflash_ds.data.prompt_grid import natural_prompts, split_prompts, write_jsonl
from dflash_ds.errors import DFlashError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the make-prompts flags."""
    parser.add_argument("--out", required=True, help="output folder: train.jsonl and held_out.jsonl (one user turn "
                        "a row, with `kind` and `topic`), inputs of `regenerate` and `eval`")
    parser.add_argument("--seed", type=int, default=0, help="seed of the math problems and of the held-out topics")
    parser.add_argument("--held-out", type=int, default=64, help="held-out prompts (default 64); whole topics, "
                        "none of which appears in train.jsonl")
    parser.add_argument("--train", type=int, default=None, help="keep only the first N (shuffled) training prompts "
                        "(default: all)")


def run(args: argparse.Namespace) -> int:
    """CLI entry: build, split and write the prompt set; print the counts by task type."""
    train, held = split_prompts(natural_prompts(args.seed), args.seed, args.held_out)
    if args.train is not None:
        if args.train < 1:
            raise DFlashError(f"--train {args.train}: must be >= 1")
        train = train[: args.train]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "held_out.jsonl")
    for name, rows in (("train", train), ("held_out", held)):
        kinds = Counter(r["kind"] for r in rows)
        by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        print(f"{out / (name + '.jsonl')}: {len(rows)} prompts ({by_kind})")
    return 0
