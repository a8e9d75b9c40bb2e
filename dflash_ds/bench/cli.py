"""`dflash-ds bench NAME`: one module per benchmark, wired here by name.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`.
All of them are imported to build `--help`, so a benchmark imports its heavy
dependencies (torch.distributed, deepspeed) inside `run`, not at module top.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "attention": (
        "dflash_ds.bench.attention",
        "the drafter's forward+backward under each block-sparse mask backend (dense SDPA, flex_attention)",
    ),
    "batching": (
        "dflash_ds.bench.batching",
        "padding efficiency of length-bucketed token-budget batching vs random pad-to-longest batches",
    ),
    "comm": (
        "dflash_ds.bench.comm",
        "point-to-point bandwidth of every target->drafter pair: raw send/recv vs the training exchange",
    ),
    "context-falloff": (
        "dflash_ds.bench.context_falloff",
        "held-out tau by context length of a drafter trained on short rows vs one trained on long rows, on a tiny "
        "sliding-window target that holds at 32K or on a real target's own prepared rows",
    ),
    "curve": (
        "dflash_ds.bench.curve",
        "held-out tau against training tokens: every checkpoint a run kept, evaluated on the same prompts",
    ),
    "fuse": (
        "dflash_ds.bench.fuse",
        "each function train.fuse compiles (the loss core, the layers' RMSNorm, RoPE and SwiGLU, a kind's own "
        "parts), eager against compiled at a target's real widths",
    ),
    "kinds": (
        "dflash_ds.bench.kinds",
        "every drafter kind x depth x seed trained on a target's own answers, held-out tau at each step budget "
        "(the real-target table)",
    ),
    "long-context": (
        "dflash_ds.bench.long_context",
        "one long sequence per micro-batch on CPU at a tiny target: the target forward's and a colocated step's "
        "peak memory at each length, measured vs memory/long_context.py",
    ),
    "memory": (
        "dflash_ds.bench.memory",
        "peak memory and time of one drafter micro-step at small widths, measured vs predicted, and the "
        "predicted per-rank total at full width",
    ),
    "pipeline": (
        "dflash_ds.bench.pipeline",
        "target and drafter capacity, the real pipeline's tokens/s, and the colocated trainer's",
    ),
    "real-shape": (
        "dflash_ds.bench.real_shape",
        "colocated training at a published target's shape on one GPU (random target made on the device, the "
        "drafter in DeepSpeed): tokens/s, MFU of each part, peak memory vs plan",
    ),
    "recipe": (
        "dflash_ds.bench.recipe",
        "train K recipes over seeds on the same data and evaluate each export on held-out prompts: tau per recipe "
        "with its spread",
    ),
    "speedup": (
        "dflash_ds.bench.speedup",
        "how much faster the target decodes with the drafter: plain vs speculative output tokens/s (vLLM at each "
        "concurrency, our decoder at batch 1), outputs checked equal, the step costs and the speedup tau predicts",
    ),
    "target-load": (
        "dflash_ds.bench.target_load",
        "per rank of a target replica (under torchrun: k ranks): peak resident memory while loading its shard, "
        "the parameters it holds, load and forward time",
    ),
    "zero": (
        "dflash_ds.bench.zero",
        "per-rank parameter, gradient and optimizer bytes, peak memory and step time for ZeRO 0/1/2/3",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one sub-subcommand per benchmark."""
    sub = parser.add_subparsers(dest="bench_name", metavar="BENCH", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(args._bench_run(args) or 0)
