"""`dflash-ds make-tiny-target`: write a tiny seeded target (Qwen3, `--family NAME`, or the trained `--quality`)."""

from __future__ import annotations

import argparse
import hashlib

from dflash_ds.errors import DFlashError
from dflash_ds.tiny.families import FAMILIES, make_tiny_family
from dflash_ds.tiny.target import make_tiny_target

# Shape flags of the seeded Qwen3 target (the other families are written at their toy shape, tiny/families.py).
QWEN3_SHAPE = dict(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, max_position=2048,
                   init_std=0.02)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the make-tiny-target flags."""
    d = QWEN3_SHAPE
    parser.add_argument("--out", required=True, help="output folder (HF format); must be empty or absent")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3",
                        help="architecture (default qwen3); the other families are written at a fixed toy shape "
                             "(4 layers, hidden 64), so the shape flags below are qwen3 only")
    parser.add_argument("--layers", type=int, default=None, help=f"number of decoder layers (default {d['layers']})")
    parser.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {d['hidden']})")
    parser.add_argument("--heads", type=int, default=None, help=f"attention heads (default {d['heads']})")
    parser.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads, GQA (default {d['kv_heads']})")
    parser.add_argument("--head-dim", type=int, default=None, help=f"per-head dimension (default {d['head_dim']})")
    parser.add_argument("--intermediate", type=int, default=None,
                        help=f"MLP intermediate size (default {d['intermediate']})")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer and model vocabulary size, specials included")
    parser.add_argument("--max-position", type=int, default=None,
                        help=f"max position embeddings / tokenizer max length (default {d['max_position']})")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    parser.add_argument("--init-std", type=float, default=None,
                        help=f"std of the random weights (default {d['init_std']}; larger = peakier distributions)")
    parser.add_argument("--force", action="store_true", help="overwrite files in a non-empty --out folder")
    parser.add_argument("--quality", action="store_true",
                        help="train the quality target instead of a random init: a qwen3 whose answers copy, repeat "
                             "or swap words of the prompt, so drafting needs the target's context (docs/QUALITY.md); "
                             "takes --layers, --hidden, --vocab-size, --seed and --steps")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="with --quality: every layer attends to the last W positions, and after the usual steps "
                             "the target trains 100 more on conversations of several exchanges (3 x W tokens): it then "
                             "answers right at any depth of a conversation, 32K included (bench context-falloff's "
                             "target, W 128)")
    parser.add_argument("--steps", type=int, default=None,
                        help="with --quality: training steps (default 300, about 25 s on 2 CPU cores)")


def run(args: argparse.Namespace) -> int:
    """CLI entry: build the tiny target and print a summary."""
    from dflash_ds.models.target import read_target_config

    given = {k: getattr(args, k) for k in QWEN3_SHAPE if getattr(args, k) is not None}
    for flag in ("steps", "sliding_window"):
        if getattr(args, flag) is not None and not args.quality:
            raise DFlashError(f"--{flag.replace('_', '-')} applies to --quality only")
    if args.quality:
        out = _quality(args, given)
    elif args.family == "qwen3":
        out = make_tiny_target(args.out, **{**QWEN3_SHAPE, **given}, vocab_size=args.vocab_size, seed=args.seed,
                               force=args.force)
    elif given:
        raise DFlashError(f"--{next(iter(given)).replace('_', '-')} applies to --family qwen3 only "
                          f"(--family {args.family} is written at its toy shape)")
    else:
        out = make_tiny_family(args.out, args.family, vocab_size=args.vocab_size, seed=args.seed, force=args.force)
    config = read_target_config(out)  # the text config, also for a vision-language wrapper
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    kind = "quality" if args.quality else args.family
    print(f"tiny target ({kind}): {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, {n_params:,} parameters")
    for path in sorted(out.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        print(f"  wrote {path} ({path.stat().st_size:,} bytes, sha256 {digest})")
    return 0


def _quality(args: argparse.Namespace, given: dict):
    from dflash_ds.tiny.quality import make_quality_target

    if args.family != "qwen3":
        raise DFlashError("--quality builds a qwen3 target; drop --family")
    other = [k for k in given if k not in ("layers", "hidden")]
    if other:
        flag = other[0].replace("_", "-")
        raise DFlashError(f"--{flag} does not apply to --quality (it takes --layers and --hidden)")
    return make_quality_target(args.out, **given, vocab_size=args.vocab_size, seed=args.seed, force=args.force,
                               **({"steps": args.steps} if args.steps is not None else {}), log_every=100,
                               **({"sliding_window": args.sliding_window, "row_tokens": 3 * args.sliding_window}
                                  if args.sliding_window else {}))


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
