"""`dflash-ds bench batching`: how much of the padded compute is real tokens.

Simulates a ShareGPT-like corpus (log-normal lengths) and compares the
length-bucketed token-budget batching of `dflash_ds.data.batching` with what
colocated drafter trainers do (random batches of a fixed size, padded to the
longest sequence), plus two controls: random order packed to the token budget,
and buckets without sorting inside them. Pure Python/NumPy; no torch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dflash_ds.data.batching import BatchSpec, bucket_boundaries, build_epoch, longest_run, pack_token_budget
from dflash_ds.errors import DFlashError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench batching`."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--num-samples", type=int, default=50000, help="number of simulated sequences")
    parser.add_argument("--median", type=float, default=600.0, help="median sequence length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of the log-normal length distribution")
    parser.add_argument("--max-length", type=int, default=4096, help="lengths are clipped to [16, max length]")
    parser.add_argument("--token-budget", type=int, default=16384, help="padded tokens per batch (budgeted strategies)")
    parser.add_argument(
        "--batch-size", type=int, default=4, help="sequences per batch of random pad-to-longest batching"
    )
    parser.add_argument("--num-buckets", type=int, default=6, help="length buckets up to max length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated lengths and of the batch order")
    parser.add_argument("--repeats", type=int, default=3, help="epochs built per strategy to time it (best is kept)")


def sharegpt_like_lengths(num_samples: int, median: float, sigma: float, max_length: int, seed: int) -> np.ndarray:
    """Log-normal token counts clipped to [16, max_length], like multi-turn chat data."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(median), sigma, num_samples)
    return np.clip(np.rint(raw), min(16, max_length), max_length).astype(np.int64)


def _random_fixed_size(lengths: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[BatchSpec]:
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    specs = []
    for k, start in enumerate(range(0, len(order), batch_size)):
        ids = order[start : start + batch_size]
        lens = lengths[ids]
        specs.append(BatchSpec(k, 0, ids.tolist(), int(lens.sum()), len(ids) * int(lens.max())))
    return specs


def _random_token_budget(lengths: np.ndarray, token_budget: int, seed: int, epoch: int) -> list[BatchSpec]:
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    lens = lengths[order].tolist()
    specs = []
    for k, (s, e) in enumerate(pack_token_budget(lens, token_budget)):
        specs.append(BatchSpec(k, 0, order[s:e].tolist(), sum(lens[s:e]), (e - s) * max(lens[s:e])))
    return specs


def _measure(build: Callable[[int], list[BatchSpec]], repeats: int, bucketed: bool) -> dict[str, Any]:
    best = float("inf")
    for epoch in range(repeats):
        start = time.perf_counter()
        specs = build(epoch)
        best = min(best, time.perf_counter() - start)
    specs = build(0)  # report epoch 0; timing only used the loop above
    n = len(specs)
    real = sum(s.real_tokens for s in specs)
    padded = sum(s.padded_tokens for s in specs)
    out: dict[str, Any] = {
        "padding_efficiency": real / padded,
        "num_batches": n,
        "mean_sequences_per_batch": sum(s.num_seqs for s in specs) / n,
        "max_padded_tokens": max(s.padded_tokens for s in specs),
        "batches_per_sec": n / best if best > 0 else float("inf"),
        "longest_same_bucket_run": None,
        "earliest_bucket_end": None,
        "bucket_num_batches": None,
        "bucket_end_fraction": None,
    }
    if bucketed:
        buckets = [s.bucket for s in specs]
        last = {b: i for i, b in enumerate(buckets)}
        out["longest_same_bucket_run"] = longest_run(buckets)
        # Fraction of the epoch done when each bucket runs out (1.0 = at the very end);
        # stride interleaving puts it about 1 / (2 n_b) before the end.
        out["bucket_num_batches"] = [buckets.count(b) for b in range(max(buckets) + 1)]
        out["bucket_end_fraction"] = [(last[b] + 1) / n if b in last else None for b in range(max(buckets) + 1)]
        out["earliest_bucket_end"] = (min(last.values()) + 1) / n
    return out


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every strategy on the simulated corpus; returns the JSON-ready result."""
    if args.num_samples < 1 or args.repeats < 1 or args.batch_size < 1:
        raise DFlashError("--num-samples, --repeats and --batch-size must be >= 1")
    if args.max_length > args.token_budget:
        raise DFlashError(f"--max-length {args.max_length} must be <= --token-budget {args.token_budget}")
    lengths = sharegpt_like_lengths(args.num_samples, args.median, args.sigma, args.max_length, args.seed)
    bounds = bucket_boundaries(args.max_length, args.num_buckets)
    budget, seed = args.token_budget, args.seed
    strategies: dict[str, tuple[Callable[[int], list[BatchSpec]], bool]] = {
        "bucketed": (lambda e: build_epoch(lengths, budget, bounds, seed, e), True),
        "bucketed_unsorted": (lambda e: build_epoch(lengths, budget, bounds, seed, e, sort_window=1), True),
        "random_pad_to_longest": (lambda e: _random_fixed_size(lengths, args.batch_size, seed, e), False),
        "random_token_budget": (lambda e: _random_token_budget(lengths, budget, seed, e), False),
    }
    result: dict[str, Any] = {
        "config": {
            "num_samples": args.num_samples,
            "median": args.median,
            "sigma": args.sigma,
            "max_length": args.max_length,
            "token_budget": budget,
            "batch_size": args.batch_size,
            "num_buckets": len(bounds),
            "boundaries": bounds,
            "seed": seed,
            "mean_length": float(lengths.mean()),
            "median_length": float(np.median(lengths)),
        }
    }
    for name, (build, bucketed) in strategies.items():
        result[name] = _measure(build, args.repeats, bucketed)
    return result


LABELS = {
    "bucketed": "bucketed, sorted (ours)",
    "bucketed_unsorted": "bucketed, unsorted",
    "random_pad_to_longest": "random, batch of {batch_size}",
    "random_token_budget": "random, budget",
}


def _rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, label in LABELS.items():
        r = result[name]
        run_len = "-" if r["longest_same_bucket_run"] is None else str(r["longest_same_bucket_run"])
        rows.append([
            label.format(**result["config"]),
            f"{r['padding_efficiency']:.4f}",
            str(r["num_batches"]),
            f"{r['mean_sequences_per_batch']:.1f}",
            run_len,
            f"{r['batches_per_sec']:,.0f}",
        ])
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench batching`."""
    result = run_bench(args)
    if args.json:
        print(json.dumps(result))
        return 0
    c = result["config"]
    title = (
        f"batching: {c['num_samples']} log-normal lengths (median {c['median_length']:.0f}, "
        f"mean {c['mean_length']:.0f}, max {c['max_length']}), token budget {c['token_budget']}, "
        f"buckets {c['boundaries']}"
    )
    header = ["strategy", "eff.", "batches", "seqs/b", "run", "batch/s"]
    rows = _rows(result)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        print(title)
        print("eff. = real / padded tokens; run = longest same-bucket run")
        for line in [header, *rows]:
            print("  ".join(x.ljust(w) for x, w in zip(line, widths)))
    else:
        table = Table(title=title, caption="eff. = real / padded tokens; run = longest same-bucket run")
        for k, h in enumerate(header):
            table.add_column(h, justify="left" if k == 0 else "right", no_wrap=True)
        for line in rows:
            table.add_row(*line)
        Console().print(table)
    ours = result["bucketed"]
    pairs = zip(ours["bucket_end_fraction"], ours["bucket_num_batches"])
    ends = ", ".join(f"{b}: {e:.1%} ({k})" for b, (e, k) in enumerate(pairs) if k)
    print(f"bucketed: each bucket runs out at (fraction of epoch, batches): {ends}")
    return 0
