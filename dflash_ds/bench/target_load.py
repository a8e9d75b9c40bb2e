"""`dflash-ds bench target-load`: what each rank of a target replica holds and reads while loading its shard.

Run under torchrun with k ranks (`torchrun --nproc_per_node k -m dflash_ds bench target-load --target DIR`):
the k ranks form one replica and load the target sharded over them as a training job's target ranks do
(`load_target(tp_size=k)`, transformers' tensor parallelism); without torchrun, one rank loads it whole.
Per rank: resident memory before loading, its peak while loading and after one forward + capture of
`--tokens` tokens (the process's high-water mark, which counts the safetensors pages it touched: an
unsharded load memory-maps the file and reads a weight only when a forward first uses it), the parameter
bytes it holds, the load and forward times (every rank of the replica runs the forward). docs/MEMORY.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

GB = 1e9


def _rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class MemorySampler:
    """Peaks of this process's anonymous resident memory and proportional set size, sampled every 10 ms.

    RSS alone misleads here: it counts every page of a memory-mapped safetensors file the process touched,
    and the k ranks of a node map the same file (one copy in the page cache, counted k times). RssAnon is
    what the rank owns (its copies of the weights, activations); Pss splits shared file pages between the
    processes that map them, so it sums to the node's real use.
    """

    def __init__(self) -> None:
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0, "Pss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Read the counters once and keep the maxima."""
        for path, keys in (("/proc/self/status", ("RssAnon", "RssFile")), ("/proc/self/smaps_rollup", ("Pss",))):
            try:
                with open(path) as f:
                    for line in f:
                        key = line.split(":", 1)[0]
                        if key in keys:
                            self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def stop(self) -> dict[str, float]:
        """Stop sampling; the peaks in GB."""
        self._stop.set()
        self._thread.join()
        self.sample()
        return {f"peak_{k.lower()}_gb": v / GB for k, v in self.peak.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench target-load flags."""
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="load dtype (default fp32)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the timed forward (default 512; 0: none)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")


def run(args: argparse.Namespace) -> int:
    """Load (a shard of) the target on every rank, measure, and print one line per rank from rank 0."""
    import torch
    import torch.distributed as dist

    from dflash_ds.models.target import capture_hidden, load_target, read_target_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    before = _rss_bytes()
    sampler = MemorySampler()
    t0 = time.perf_counter()
    model = load_target(args.target, dtype=dtype, tp_size=world)
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    held = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    forward_s = None
    if args.tokens:
        cfg = read_target_config(args.target)
        ids = torch.randint(0, int(cfg["vocab_size"]), (1, args.tokens), generator=torch.Generator().manual_seed(0))
        layers = [0, int(cfg["num_hidden_layers"]) - 1]
        capture_hidden(model, ids, torch.ones_like(ids), layers)  # warm-up
        t1 = time.perf_counter()
        capture_hidden(model, ids, torch.ones_like(ids), layers)
        forward_s = time.perf_counter() - t1
    # After a forward every weight has been read: safetensors loaded without a copy are memory-mapped, and
    # count in the resident set only once touched (the high-water mark at load would miss them).
    peak_used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = sampler.stop()
    mine = {"rank": int(os.environ.get("RANK", "0")), "rss_before_gb": before / GB, "peak_rss_gb": peak / GB,
            "peak_minus_before_gb": (peak - before) / GB,
            "peak_after_forward_gb": peak_used / GB if args.tokens else None, "params_held_gb": held / GB, "load_s": load_s,
            "forward_s": forward_s, **peaks}
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        dist.destroy_process_group()
    if mine["rank"] == 0:
        result = {"target": args.target, "tp_size": world, "dtype": args.dtype, "tokens": args.tokens, "ranks": ranks}
        for r in ranks:
            fwd = (f"; after a forward ({r['forward_s']:.2f} s) peak {r['peak_after_forward_gb']:.2f} GB"
                   if r["forward_s"] is not None else "")
            fwd += (f"; peak anonymous {r['peak_rssanon_gb']:.2f} GB, peak PSS {r['peak_pss_gb']:.2f} GB, peak file "
                    f"pages {r['peak_rssfile_gb']:.2f} GB")
            print(f"rank {r['rank']} of {world}: holds {r['params_held_gb']:.2f} GB of parameters; RSS "
                  f"{r['rss_before_gb']:.2f} GB before loading, peak {r['peak_rss_gb']:.2f} GB "
                  f"(+{r['peak_minus_before_gb']:.2f} GB) loading ({r['load_s']:.1f} s){fwd}", flush=True)
        if args.json:
            print(json.dumps(result))
    return 0
