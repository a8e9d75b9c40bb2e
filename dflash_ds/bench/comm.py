"""`dflash-ds bench comm`: point-to-point bandwidth of every target -> drafter pair.

Launched like training (`torchrun --nproc_per_node N -m dflash_ds bench comm`); the layout is
training's (drafters on the first ranks, targets on the last), so rank 0 is a drafter and prints.

Per pair and message size, two rows in nccl-tests' sendrecv units (size, time per message in
us, algbw = bytes / time in GB/s; busbw equals algbw for point-to-point):

- raw: one tensor, `bridge.send` / `bridge.recv`, one message at a time;
- exchange: what training sends, a header plus a dict shaped like a training batch
  (input_ids, loss_mask, lengths, and a context tensor holding most of the bytes), posted
  by `AsyncSender` (2 batches in flight) and received as the training drafter receives
  (`bridge.Receiver` with the payload shapes planned: header and payload receives posted 2
  batches ahead, into pooled buffers). Both send buffers hold random bytes, and the batch is
  built in place as the target builds it (one payload message, no staging copy).

Time is measured on the receiving drafter: a "go" message from the drafter starts the
sender, so the clock starts when the first byte may move and stops when the last message
has landed. raw and exchange alternate for `--rounds` rounds and the median round counts.
Pairs run one at a time (a store barrier between them) so they never share links.

The helpers at the bottom (tables, store barrier, stdout guard) are shared by the other
multi-rank benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Iterator

from dflash_ds.bench.table import print_table

GPU_SIZES = "64K,256K,1M,4M,16M,64M,256M"
CPU_SIZES = "64K,256K,1M,4M,16M,64M"  # gloo over loopback: 256M only makes the run slow
RAW_TAG, GO_TAG, EXCHANGE_CHANNEL = 120, 121, 50
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench comm`."""
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated message sizes with K/M/G suffixes (binary); default {GPU_SIZES} "
                             f"on GPU, {CPU_SIZES} on CPU")
    parser.add_argument("--iters", type=int, default=None, help="timed messages per size (default 20 GPU, 5 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed messages per size first (default 5 GPU, 1 CPU)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="raw and exchange alternate this many times per size; the median round is reported")
    parser.add_argument("--num-target-ranks", type=int, default=1,
                        help="target ranks (the last ones; the others are drafters), as in training")
    parser.add_argument("--targets-per-node", type=int, default=0,
                        help="per-node layout: the last N local ranks of every node are targets")
    parser.add_argument("--feature-dim", type=int, default=2560,
                        help="width of the exchanged context tensor (n target layers x hidden)")
    parser.add_argument("--config", default=None,
                        help="YAML/JSON run config (of its target only config.json is read): adds a row, marked *, "
                             "for one full training batch of that run (token budget x bytes per token: selected "
                             "layers, final hidden if loss.kl_weight > 0, ids and mask, in the run's dtype)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override of --config, repeatable (e.g. --set data.token_budget=16384)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="timeout of every transfer (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (last stdout line) instead of tables")


def parse_sizes(text: str) -> list[int]:
    """'64K,1M,2048' -> [65536, 1048576, 2048] (binary units)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("B").removesuffix("I")
        unit = item[-1] if item and item[-1] in _UNITS else ""
        try:
            value = float(item[: len(item) - len(unit)])
        except ValueError:
            from dflash_ds.errors import DFlashError

            raise DFlashError(f"--sizes: cannot read {item!r} (use e.g. 64K,1M,256M)") from None
        sizes.append(max(1, int(value * _UNITS[unit])))
    return sizes


def human_bytes(n: float) -> str:
    """65536 -> '64K' (binary units, as nccl-tests' size column reads)."""
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit]:
            exact = n % _UNITS[unit] == 0
            return f"{int(n // _UNITS[unit])}{unit}" if exact else f"{n / _UNITS[unit]:.2f}{unit}"
    return str(int(n))




def training_like_specs(nbytes: int, feature_dim: int, dtype, last_dim: int = 0) -> list:
    """(name, dtype, shape) of a payload shaped like one training batch, of about `nbytes` bytes."""
    from dflash_ds.distributed.wire import bytes_per_token, payload_specs_for

    tokens = max(1, nbytes // bytes_per_token(feature_dim, last_dim, dtype))
    rows = max(1, tokens // 2048)  # sequences of up to ~2k tokens, as training batches hold
    return payload_specs_for(rows, max(1, tokens // rows), feature_dim, last_dim, dtype)


def training_like_batch(nbytes: int, feature_dim: int, dtype, device, last_dim: int = 0) -> dict[str, Any]:
    """A payload dict of `training_like_specs`, built in place as the target builds it.

    The tensors are views of one payload buffer (`bridge.packed_empty`), so sending them copies
    nothing, and hold random values: a never-written buffer would be read from the kernel's
    shared zero page, which is faster than real memory and flatters a transfer. `last_dim` > 0
    adds the final hidden state (sent when the loss has a KL term).
    """
    from dflash_ds.distributed.payload import packed_empty

    batch = packed_empty(training_like_specs(nbytes, feature_dim, dtype, last_dim), device)
    batch["input_ids"].random_(0, 1000)
    batch["loss_mask"].fill_(1)
    batch["lengths"].fill_(batch["input_ids"].shape[1])
    batch["context"].normal_()
    if last_dim:
        batch["last_hidden"].normal_()
    return batch


def config_batch(config: str, overrides: list[str], cuda: bool) -> dict[str, Any]:
    """Shape and payload bytes of one full training batch (token budget tokens) of a run config."""
    from dflash_ds.config import load_config, parse_overrides
    from dflash_ds.distributed.wire import bytes_per_token
    from dflash_ds.runtime.job import resolve_arch, torch_dtype

    cfg = load_config(config, parse_overrides([f"--{item}" for item in overrides]))
    arch = resolve_arch(cfg)
    dtype = torch_dtype(cfg, cuda)
    feature_dim = len(arch.target_layer_ids) * arch.hidden_size
    last_dim = arch.hidden_size if cfg.loss.needs_last_hidden else 0
    per_token = bytes_per_token(feature_dim, last_dim, dtype)
    return {"config": config, "token_budget": cfg.data.token_budget, "feature_dim": feature_dim, "last_dim": last_dim,
            "dtype": str(dtype).removeprefix("torch."), "bytes_per_token": per_token,
            "bytes": cfg.data.token_budget * per_token}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_pair(ctx, src: int, dst: int, cases: list[dict[str, Any]], iters: int, warmup: int,
                  timeout_s: float, rounds: int = 1) -> list[dict[str, Any]]:
    """Run both benchmarks of one pair; returns rows on the drafter (dst), [] on the target (src).

    A case is {"size", "feature_dim", "last_dim", "dtype", "training_batch"}: the exchange sends a
    training-shaped batch of about `size` bytes with those widths.

    raw and exchange alternate for `rounds` rounds of `iters` messages (warm-up before the first
    round only); each row's time is the median round's, so a slow spell on shared cores hits
    both kinds alike instead of whichever ran during it.
    """
    import torch

    from dflash_ds.distributed import bridge as bridge_mod

    me, dev, br = ctx.global_rank, ctx.device, ctx.bridge
    go = torch.ones(1, dtype=torch.long, device=dev)
    pool = bridge_mod.BufferPool(dev)  # the drafter's receive buffers, reused as in training
    rows: list[dict[str, Any]] = []
    for case in cases:
        size = case["size"]
        raw = torch.empty(size, dtype=torch.uint8, device=dev)
        if me == src:  # real bytes: an unwritten buffer is read from the shared zero page (see training_like_batch)
            raw.random_(0, 256)
        shape = (size, case["feature_dim"], getattr(torch, case["dtype"]))
        batch = training_like_batch(*shape, dev, case["last_dim"]) if me == src else None
        planned = training_like_specs(*shape, case["last_dim"])  # as the trainer plans its receives
        times: dict[str, list[float]] = {"raw": [], "exchange": []}
        nbytes = {"raw": size, "exchange": size}
        for r in range(rounds):
            for kind in ("raw", "exchange"):
                for phase_iters in ((warmup, iters) if r == 0 else (iters,)):
                    if me == src:
                        bridge_mod.wait_all([br.recv([go], dst, GO_TAG)], dst, timeout_s, "waiting for go")
                        if kind == "raw":
                            for _ in range(phase_iters):
                                bridge_mod.wait_all([br.send([raw], dst, RAW_TAG)], dst, timeout_s, "raw send")
                        else:
                            sender = bridge_mod.AsyncSender(br, depth=2, timeout_s=timeout_s, device=dev)
                            for i in range(phase_iters):
                                sender.send(dst, batch, {"i": float(i)}, batch_id=i, tag=EXCHANGE_CHANNEL)
                            sender.flush()
                        continue
                    bridge_mod.wait_all([br.send([go], src, GO_TAG)], src, timeout_s, "sending go")
                    t0 = time.perf_counter()
                    if kind == "raw":
                        for _ in range(phase_iters):
                            bridge_mod.wait_all([br.recv([raw], src, RAW_TAG)], src, timeout_s, "raw recv")
                    else:  # the training drafter's receiver: receives planned 2 ahead, pooled buffers
                        for got in bridge_mod.Receiver(br, [(i, src, planned) for i in range(phase_iters)], depth=2,
                                                       timeout_s=timeout_s, tag=EXCHANGE_CHANNEL, device=dev,
                                                       pool=pool):
                            nbytes[kind] = sum(t.numel() * t.element_size() for t in got.tensors.values())
                            pool.release(got.tensors)  # as the training loop does after its step
                    _sync(dev)
                    elapsed = time.perf_counter() - t0
                if me == dst:
                    times[kind].append(elapsed / max(iters, 1))
        if me != dst:
            continue
        for kind in ("raw", "exchange"):
            sec = sorted(times[kind])[len(times[kind]) // 2]
            rows.append({"src": src, "dst": dst, "size": size, "kind": kind, "bytes": nbytes[kind],
                         "time_us": sec * 1e6, "algbw_gbs": nbytes[kind] / sec / 1e9 if sec > 0 else 0.0,
                         "rounds_us": [t * 1e6 for t in times[kind]], "training_batch": case["training_batch"]})
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench comm` (one process per rank)."""
    from dflash_ds.config import Config
    from dflash_ds.distributed.launch_env import read_launch_env
    from dflash_ds.distributed.topology import init_role_groups, shutdown
    from dflash_ds.errors import DFlashError
    from dflash_ds.runtime.launch import job_layout

    env = read_launch_env()
    cfg = Config()
    cfg.topology.num_target_ranks = args.num_target_ranks
    cfg.topology.targets_per_node = args.targets_per_node
    layout = job_layout(cfg, env.world_size, env.local_world_size)
    import torch

    cuda = torch.cuda.is_available()
    sizes = parse_sizes(args.sizes or (GPU_SIZES if cuda else CPU_SIZES))
    iters = args.iters if args.iters is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if iters < 1 or warmup < 0 or args.rounds < 1:
        raise DFlashError("--iters and --rounds must be >= 1 and --warmup >= 0")
    dtype = "bfloat16" if cuda else "float32"
    cases = [{"size": n, "feature_dim": args.feature_dim, "last_dim": 0, "dtype": dtype, "training_batch": False}
             for n in sizes]
    training = config_batch(args.config, args.set, cuda) if args.config else None  # before any group: errors early
    if training is not None:
        cases.append({"size": training["bytes"], "feature_dim": training["feature_dim"],
                      "last_dim": training["last_dim"], "dtype": training["dtype"], "training_batch": True})
        cases.sort(key=lambda c: c["size"])
    backend = "nccl" if cuda else "gloo"
    ctx = init_role_groups(layout, env.rank, env.master_addr, env.master_port, backend=backend,
                           timeout_s=args.timeout_s, local_rank=env.local_rank)
    pairs = [(t, d) for t in layout.target_ranks for d in layout.drafter_ranks]
    with quiet_stdout(enabled=args.json):
        for k, (t, d) in enumerate(pairs):
            store_barrier(ctx.store, f"bench/comm/pair{k}", layout.world_size, args.timeout_s)
            if ctx.global_rank in (t, d):
                rows = _measure_pair(ctx, t, d, cases, iters, warmup, args.timeout_s, args.rounds)
                if ctx.global_rank == d:
                    ctx.store.set(f"bench/comm/result/{k}", json.dumps(rows))
        result = None
        if ctx.global_rank == 0:
            rows = [r for k in range(len(pairs)) for r in json.loads(ctx.store.get(f"bench/comm/result/{k}"))]
            result = {"backend": backend, "layout": {"targets": layout.target_ranks, "drafters": layout.drafter_ranks},
                      "iters": iters, "warmup": warmup, "rounds": args.rounds, "feature_dim": args.feature_dim,
                      "payload_dtype": dtype, "training_batch": training, "results": rows,
                      "ratio": _ratios(rows)}
    shutdown(ctx)
    if result is not None:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print(result)
    return 0


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """exchange algbw / raw algbw per (pair, size): 1.0 means the exchange costs nothing extra."""
    raw = {(r["src"], r["dst"], r["size"]): r for r in rows if r["kind"] == "raw"}
    out = []
    for r in rows:
        base = raw.get((r["src"], r["dst"], r["size"]))
        if r["kind"] == "exchange" and base and base["algbw_gbs"] > 0:
            out.append({"src": r["src"], "dst": r["dst"], "size": r["size"],
                        "ratio": r["algbw_gbs"] / base["algbw_gbs"], "training_batch": r["training_batch"]})
    return out


def _print(result: dict[str, Any]) -> None:
    ratio = {(r["src"], r["dst"], r["size"]): r["ratio"] for r in result["ratio"]}
    pairs = sorted({(r["src"], r["dst"]) for r in result["results"]})
    for src, dst in pairs:
        rows = []
        for r in result["results"]:
            if (r["src"], r["dst"]) != (src, dst):
                continue
            x = ratio.get((src, dst, r["size"])) if r["kind"] == "exchange" else None
            rows.append([human_bytes(r["size"]) + ("*" if r["training_batch"] else ""), r["kind"], str(r["bytes"]),
                         f"{r['time_us']:.1f}",
                         f"{r['algbw_gbs']:.3f}", "" if x is None else f"{x:.2f}"])
        print_table(f"bench comm: target rank {src} -> drafter rank {dst} ({result['backend']}, "
                    f"median of {result['rounds']} alternating rounds of {result['iters']} messages, "
                    f"exchange payload {result['payload_dtype']}"
                    + (f", * row {result['training_batch']['dtype']}" if result["training_batch"] else "") + ")",
                    ["size", "kind", "bytes", "time (us)", "algbw (GB/s)", "exch/raw"], rows,
                    "algbw = bytes / time per message (nccl-tests units; busbw = algbw for send/recv); "
                    "exch/raw = exchange algbw / raw algbw" + _training_caption(result["training_batch"]))


def _training_caption(t: dict[str, Any] | None) -> str:
    if t is None:
        return ""
    return (f"\n* one full training batch of {t['config']}: token budget {t['token_budget']:,} x {t['bytes_per_token']:,} "
            f"B/token ({t['feature_dim']} context + {t['last_dim']} final hidden values in {t['dtype']}, "
            f"16 B of ids and mask) = {t['bytes']:,} B")


# ---------------------------------------------------------------- shared by the multi-rank benches


def store_barrier(store, key: str, world: int, timeout_s: float) -> None:
    """Wait until `world` ranks have reached `key` (through the shared TCPStore: needs no process group)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            from dflash_ds.errors import DFlashError

            raise DFlashError(f"store barrier {key}: only {store.add(key, 0)} of {world} ranks arrived "
                              f"within {timeout_s:g}s")
        time.sleep(0.01)


@contextlib.contextmanager
def quiet_stdout(enabled: bool = True) -> Iterator[None]:
    """Send everything written to fd 1 (DeepSpeed logs, status lines) to stderr, so --json output stays clean."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
