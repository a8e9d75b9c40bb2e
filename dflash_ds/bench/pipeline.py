"""`dflash-ds bench pipeline`: is the target -> drafter pipeline as fast as its slower stage?

Launched like training (`torchrun --nproc_per_node N -m dflash_ds bench pipeline --target T
--data D`), with training's layout (drafters first, targets last; rank 0 prints). One job, the
same ranks and the same global batch stream for five measurements, in this order:

(d) colocated: the colocated trainer itself (`--colocate`: every rank runs the target forward and
    then the drafter step, one DeepSpeed engine data-parallel over all ranks) on every rank, in
    child processes (`bench/colocated.py`) before the parent loads any model.
(d') serial: the colocated trainer on rank 0 alone (the other ranks idle): both stages in series
    on one rank, what overlapping them gains, on world-size times the ranks.
(a) target capacity: each target rank runs forward + capture of the batches routed to it.
(b) drafter capacity: each drafter rank runs the DeepSpeed step on the states of its batches,
    captured by an untimed pass of the targets and held in memory.
    (a) and (b) are timed one after the other, the other ranks idle; with --concurrent at the
    same time, every rank kept busy until all are done. On dedicated devices the two agree;
    on shared CPU cores the first overstates a stage's capacity and the second understates it.
(c) pipeline: the trainer itself (`run_target` / `run_drafter`) on the same groups, writing
    metrics.jsonl to a scratch folder; tokens/s is read from its records.

Each phase runs `--steps` steps and times all but the first `--warmup-steps` (for (c), the
first log window, which is dropped). Tokens are real (non-padding) tokens, summed over the
ranks of a phase and divided by the slowest rank's time. The per-batch work of every phase is
in `bench/stages.py`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash_ds.bench.comm import quiet_stdout, store_barrier
from dflash_ds.bench.stages import capture, make_engine, put, timed, train_step
from dflash_ds.bench.table import print_table
from dflash_ds.config import Config  # light (dataclasses, yaml): fine for the --help import

BENCH_CHANNEL = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench pipeline`."""
    parser.add_argument("--target", required=True, help="local HF folder of the frozen target model")
    parser.add_argument("--data", required=True, help="prepared dataset folder (dflash-ds prepare)")
    parser.add_argument("--config", default=None, help="YAML/JSON run config, as for training")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override, repeatable (e.g. --set model.num_layers=2)")
    parser.add_argument("--steps", type=int, default=30, help="steps per phase (each drafter trains one batch a step; "
                        "(b) holds the states of all of them in the drafter's memory)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps of every phase left out of the timing")
    parser.add_argument("--num-target-ranks", type=int, default=None, help="target ranks (the last ones)")
    parser.add_argument("--output-dir", default="", help="scratch folder of phase (c) (default: a temporary one, removed)")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated phases (d) and (d')")
    parser.add_argument("--colocate-overlap", action="store_true",
                        help="run (d) and (d') with topology.colocate_overlap (the next batch's target forward on "
                             "a side thread / CUDA stream during the drafter step)")
    parser.add_argument("--concurrent", action="store_true",
                        help="time (a) and (b) at the same time, every rank kept busy until all are done "
                             "(default: one after the other, the other ranks idle)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="timeout of transfers and of each phase")
    parser.add_argument("--json", action="store_true", help="print one JSON object (last stdout line) instead of a table")


def bench_config(args: argparse.Namespace) -> Config:
    """The run config of every phase: --config < --set < what the bench must own."""
    from dflash_ds.config import load_config, parse_overrides
    from dflash_ds.errors import DFlashError

    if args.warmup_steps < 1 or args.steps <= args.warmup_steps:
        raise DFlashError(f"need --steps ({args.steps}) > --warmup-steps ({args.warmup_steps}) >= 1")
    overrides = parse_overrides([f"--{item}" for item in args.set])
    overrides.update({"target": args.target})
    overrides.setdefault("data", {})["path"] = args.data
    if args.num_target_ranks is not None:
        overrides.setdefault("topology", {})["num_target_ranks"] = args.num_target_ranks
    train = overrides.setdefault("train", {})
    # The first log window of (c) is exactly the warm-up; no checkpoint but the final one.
    # No acceptance walk at the records: its extra forward is not training throughput.
    train.update({"max_steps": args.steps, "log_interval": args.warmup_steps, "save_interval": 10**9,
                  "resume": "none", "stop_at": 0, "timeout_s": args.timeout_s, "est_tau_rows": 0})
    overrides.setdefault("wandb", {})["enabled"] = False
    return load_config(args.config, overrides)


def drafter_batches(data, steps: int, num_drafters: int) -> list[tuple[int, int, Any]]:
    """(step, drafter index, BatchSpec) of the first `steps` steps, as the trainer routes them."""
    from dflash_ds.data.batching import Cursor

    out = []
    for step, (_, specs) in zip(range(steps), data.steps(Cursor(0, 0))):
        out += [(step, d, spec) for d, spec in enumerate(specs)]
    return out


def _gather(store, key: str, ranks: list[int], window: int) -> dict[str, Any]:
    """Ranks' [tokens, seconds, items] -> summed tokens / slowest seconds, and summed per-rank median rates."""
    # The median over windows of `window` items (what one of (c)'s log windows holds) moves less than
    # the mean under bursts of load from other processes on a shared machine.
    parts = [json.loads(store.get(f"{key}/{r}")) for r in ranks]
    tokens, seconds = sum(p[0] for p in parts), max(p[1] for p in parts)
    rate = tokens / seconds if seconds > 0 else 0.0
    medians = []
    for _, _, items in parts:
        chunks = [items[i:i + window] for i in range(0, len(items), window)]
        medians.append(_median([sum(n for n, _ in c) / sum(t for _, t in c) for c in chunks if len(c) == window]
                               or [sum(n for n, _ in items) / max(sum(t for _, t in items), 1e-9)]))
    return {"tok_per_s": rate, "tok_per_s_per_rank": rate / len(ranks), "ranks": len(ranks),
            "tokens": tokens, "seconds": seconds, "tok_per_s_median": sum(medians)}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return 0.0 if not xs else (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def _target_work(ctx, cfg, data, batches, arch, dtype) -> tuple[list, list]:
    """(a)'s work on a target rank (forward + capture of each routed batch), and the states of an untimed pass."""
    from dflash_ds.data.batching import Cursor
    from dflash_ds.data.loader import Batch
    from dflash_ds.data.stream import load_batch
    from dflash_ds.models.target import load_target

    lay, keep = ctx.layout, cfg.loss.needs_last_hidden
    model = load_target(cfg.target, dtype=dtype, device=ctx.device, attn_implementation=cfg.train.target_attention,
                        hub_kernels=cfg.train.target_hub_kernels)
    mine = [(s, d, spec, Batch(**load_batch(data.dataset, spec), spec=spec, cursor=Cursor(0, 0)))
            for s, d, spec in batches if lay.route(s, d) == ctx.role_rank]
    captured = [(s, d, capture(model, b, arch, ctx.device, keep)) for s, d, _, b in mine]
    work = [(s, spec.real_tokens, functools.partial(capture, model, b, arch, ctx.device, keep)) for s, _, spec, b in mine]
    return work, captured


def _drafter_work(ctx, cfg, batches, received: list, arch, dtype) -> tuple[list, Any]:
    """(b)'s work on a drafter rank (one DeepSpeed step per held batch), and the engine."""
    engine = make_engine(cfg, arch, dtype, ctx.device)
    tokens = {s: spec.real_tokens for s, d, spec in batches if d == ctx.role_rank}
    return [(s, tokens[s], functools.partial(train_step, engine, cfg, got.tensors, got.batch_id, s, dtype))
            for s, got in enumerate(received)], engine


def _measure_stages(ctx, work: list, args) -> None:
    """(a) and (b): one after the other (targets' turn, then drafters'), or at the same time with --concurrent."""
    world = ctx.layout.world_size
    turns = [None] if args.concurrent else [True, False]
    for k, turn in enumerate(turns):
        store_barrier(ctx.store, f"bench/pipeline/ab{k}", world, args.timeout_s)
        if turn is None or turn == ctx.is_target:
            put(ctx.store, f"bench/pipeline/{'a' if ctx.is_target else 'b'}/{ctx.global_rank}",
                 timed(work, args.warmup_steps, ctx.device))
        if turn is None:
            # Keep this rank busy (untimed) until every rank is done, so no stage is timed on an idle machine.
            key, i = "bench/pipeline/ab_done", 0
            ctx.store.add(key, 1)
            while ctx.store.add(key, 0) < world:
                if work:
                    work[i % len(work)][2]()
                    i += 1
                else:
                    time.sleep(0.01)


def _exchange_states(ctx, captured: list, steps: int) -> list:
    """Targets hand the states of (a) to their drafters, in the order the trainer would (untimed)."""
    from dflash_ds.distributed import bridge as bridge_mod
    lay = ctx.layout
    if ctx.is_target:
        sender = bridge_mod.AsyncSender(ctx.bridge, depth=2, timeout_s=ctx.timeout_s, device=ctx.device)
        for s, d, tensors in captured:
            sender.send(lay.drafter_ranks[d], tensors, {}, batch_id=s * lay.num_drafters + d, tag=BENCH_CHANNEL)
        sender.flush()
        return []
    d = ctx.role_rank
    return [bridge_mod.recv_batch(ctx.bridge, lay.target_rank_for(s, d),
                                  ctx.timeout_s, tag=BENCH_CHANNEL, device=ctx.device) for s in range(steps)]


def _pipeline_rate(out: Path, warmup: int) -> dict[str, Any]:
    """(c) from metrics.jsonl: real tokens over wall time of every window after the warm-up one."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in records if r["step"] > warmup]
    tokens = int(sum(r["real_tokens"] for r in timed))
    seconds = sum(r["real_tokens"] / r["tok_per_sec"] for r in timed if r["tok_per_sec"] > 0)
    return {"tok_per_s": tokens / seconds if seconds > 0 else 0.0, "tokens": tokens, "seconds": seconds,
            "tok_per_s_median": _median([r["tok_per_sec"] for r in timed]),
            "hs_queue_depth": sum(r["hs_queue_depth"] for r in timed) / max(len(timed), 1),
            "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"]}


def _colocated_rate(out: Path, phase: str, args, drafters: int, world: int) -> dict[str, Any]:
    """(d) / (d') from the colocated trainer's metrics.jsonl, as (c)'s."""
    from dflash_ds.bench.colocated import phase_steps

    _, warmup = phase_steps(args.steps, args.warmup_steps, drafters, world)
    rate = _pipeline_rate(out / f"colocated_{phase}", warmup)
    return {**rate, "ranks": world, "tok_per_s_per_rank": rate["tok_per_s"] / world,
            "overlap": bool(args.colocate_overlap)}


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench pipeline` (one process per rank)."""
    import torch

    from dflash_ds.data.stream import open_data
    from dflash_ds.distributed.launch_env import read_launch_env
    from dflash_ds.distributed.topology import init_role_groups, shutdown
    from dflash_ds.runtime.job import resolve_arch, torch_dtype
    from dflash_ds.runtime.launch import validate_job

    env = read_launch_env()
    cfg = bench_config(args)
    layout = validate_job(cfg, env.world_size, env.local_world_size)
    arch = resolve_arch(cfg)
    cuda = torch.cuda.is_available()
    if not cuda:
        # One thread per rank: ranks share the cores, and each stage must get its own.
        torch.set_num_threads(1)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ctx = init_role_groups(layout, env.rank, env.master_addr, env.master_port, backend="nccl" if cuda else "gloo",
                           timeout_s=args.timeout_s, local_rank=env.local_rank)
    world, lead, dtype = layout.world_size, ctx.global_rank == 0, torch_dtype(cfg, ctx.device.type == "cuda")
    # As in training: heartbeats name a lost rank instead of leaving the others waiting at a barrier.
    from dflash_ds.runtime.watchdog import Watchdog

    watchdog = Watchdog(ctx.store, env.rank, world, lambda r: f"rank {r} ({layout.role_of(r)})",
                        cfg.train.heartbeat_timeout_s).start()
    if lead:
        out = Path(args.output_dir or tempfile.mkdtemp(prefix="dflash_bench_pipeline_"))
        ctx.store.set("bench/pipeline/out", str(out))
    out = Path(ctx.store.get("bench/pipeline/out").decode())
    cfg.train.output_dir = str(out)
    result = None
    with quiet_stdout(enabled=args.json):
        data = open_data(cfg, layout.num_drafters, arch.vocab_size)
        batches = drafter_batches(data, args.steps, layout.num_drafters)
        wall = {"start": time.perf_counter()}
        if not args.no_colocated:
            from dflash_ds.bench.colocated import run_colocated

            run_colocated(ctx, env, cfg, args, "d", world, out)  # DP over every rank
            store_barrier(ctx.store, "bench/pipeline/serial", world, args.timeout_s)
            if lead:  # one colocated rank alone, the others idle: both stages in series on one device
                run_colocated(ctx, env, cfg, args, "s", 1, out)
        store_barrier(ctx.store, "bench/pipeline/a", world, args.timeout_s)
        wall["d"] = time.perf_counter()
        work, captured = _target_work(ctx, cfg, data, batches, arch, dtype) if ctx.is_target else ([], [])
        received = _exchange_states(ctx, captured, args.steps)
        del captured
        engine = None
        if not ctx.is_target:
            work, engine = _drafter_work(ctx, cfg, batches, received, arch, dtype)
        wall["setup"] = time.perf_counter()
        _measure_stages(ctx, work, args)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()  # release DeepSpeed's hooks and buffers before (c) builds the trainer's engine
        del work, received, engine
        gc.collect()
        store_barrier(ctx.store, "bench/pipeline/c", world, args.timeout_s)
        wall["ab"] = time.perf_counter()
        _run_trainer(ctx, cfg, data, watchdog, arch, dtype)
        wall["c"] = time.perf_counter()
        if lead:
            result = _result(ctx, cfg, args, arch, out)
            # Wall time of each phase, start-up included (model loads, engine builds, the final checkpoint).
            order = ["start", "d", "setup", "ab", "c"]
            result["phase_wall_s"] = {k: round(wall[k] - wall[p], 2) for p, k in zip(order, order[1:])}
    watchdog.mark_done()
    watchdog.close()
    shutdown(ctx)
    if lead:
        if not args.output_dir:
            shutil.rmtree(out, ignore_errors=True)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print(result)
    return 0


def _run_trainer(ctx, cfg, data, watchdog, arch, dtype) -> None:
    """(c): the trainer itself on this rank's role, writing metrics.jsonl to the scratch folder."""
    if ctx.is_target:
        from dflash_ds.runtime.target_worker import run_target

        run_target(ctx, cfg, data, watchdog, arch, dtype)
    else:
        from dflash_ds.runtime.drafter_worker import run_drafter
        from dflash_ds.runtime.resume import choose_resume

        run_drafter(ctx, cfg, data, watchdog, choose_resume(cfg, ctx.layout.num_drafters), arch, dtype)


def _result(ctx, cfg, args, arch, out: Path) -> dict[str, Any]:
    lay = ctx.layout
    w = args.warmup_steps  # (c)'s log window, in steps
    a = _gather(ctx.store, "bench/pipeline/a", lay.target_ranks, max(1, w * lay.num_drafters // lay.num_targets))
    b = _gather(ctx.store, "bench/pipeline/b", lay.drafter_ranks, w)
    c = _pipeline_rate(out, args.warmup_steps)
    c["tok_per_s_per_rank"] = c["tok_per_s"] / lay.world_size
    d = None if args.no_colocated else _colocated_rate(out, "d", args, lay.num_drafters, lay.world_size)
    serial = None if args.no_colocated else _colocated_rate(out, "s", args, lay.num_drafters, 1)
    import torch

    from dflash_ds.models.target import read_target_config

    return {
        "config": {"target": cfg.target, "data": cfg.data.path, "steps": args.steps, "warmup_steps": args.warmup_steps,
                   "num_target_ranks": lay.num_targets, "num_drafter_ranks": lay.num_drafters,
                   "target_layers": int(read_target_config(cfg.target)["num_hidden_layers"]),
                   "hidden_size": arch.hidden_size, "drafter_layers": arch.num_hidden_layers,
                   "block_size": arch.block_size, "num_anchors": cfg.loss.num_anchors,
                   "token_budget": cfg.data.token_budget, "zero_stage": cfg.train.zero_stage,
                   "backend": ctx.backend, "threads_per_rank": torch.get_num_threads(),
                   "stage_timing": "concurrent" if args.concurrent else "one after the other"},
        "target_capacity": a, "drafter_capacity": b, "pipeline": c, "colocated": d, "colocated_serial": serial,
        "target_over_drafter": a["tok_per_s"] / b["tok_per_s"] if b["tok_per_s"] else None,
        "efficiency": c["tok_per_s"] / min(a["tok_per_s"], b["tok_per_s"]) if min(a["tok_per_s"], b["tok_per_s"]) else None,
        "speedup": c["tok_per_s"] / d["tok_per_s"] if d and d["tok_per_s"] else None,
        # The same ratios from median rates (per step; per log window for (c)): steadier on shared machines.
        "efficiency_median": c["tok_per_s_median"] / min(a["tok_per_s_median"], b["tok_per_s_median"]),
        "speedup_median": c["tok_per_s_median"] / d["tok_per_s_median"] if d else None,
        # Against one colocated worker alone (the stages in series on one rank): what overlapping the
        # stages gains; the pipeline uses world_size ranks for it (see tok_per_s_per_rank).
        "speedup_serial": c["tok_per_s"] / serial["tok_per_s"] if serial and serial["tok_per_s"] else None,
        "speedup_serial_median": c["tok_per_s_median"] / serial["tok_per_s_median"] if serial else None,
    }


def _print(r: dict[str, Any]) -> None:
    c = r["config"]
    rows = [["(a) target capacity (forward + capture)", r["target_capacity"], f"{c['num_target_ranks']} target"],
            ["(b) drafter capacity (step from memory)", r["drafter_capacity"], f"{c['num_drafter_ranks']} drafter"],
            ["(c) pipeline (the trainer)", r["pipeline"], f"{c['num_target_ranks']}+{c['num_drafter_ranks']}"]]
    if r["colocated"]:
        rows.append(["(d) colocated trainer (--colocate), DP", r["colocated"], f"{r['colocated']['ranks']} colocated"])
    if r.get("colocated_serial"):
        rows.append(["(d') one colocated rank alone (serial)", r["colocated_serial"], "1 colocated"])
    table = [[name, ranks, f"{x['tok_per_s']:,.0f}", f"{x['tok_per_s_per_rank']:,.0f}", f"{x['tok_per_s_median']:,.0f}",
              f"{x['tokens']:,}", f"{x['seconds']:.2f}"] for name, x, ranks in rows]
    print_table(f"bench pipeline: target {c['target_layers']} layers, drafter {c['drafter_layers']} layers, "
                f"hidden {c['hidden_size']}, token budget {c['token_budget']}, ZeRO-{c['zero_stage']}, "
                f"{c['backend']}, {c['threads_per_rank']} thread(s)/rank, steps {c['warmup_steps']}..{c['steps']} timed, "
                f"(a) and (b) timed {c['stage_timing']}",
                ["phase", "ranks", "tok/s", "tok/s per rank", "median tok/s", "tokens", "seconds"], table,
                f"tokens = real (non-padding) tokens; median = over windows of {c['warmup_steps']} steps "
                "((c): its log windows)")
    print(f"a/b = {r['target_over_drafter']:.2f}; efficiency = (c) / min(a, b) = {r['efficiency']:.3f} "
          f"(medians: {r['efficiency_median']:.3f})"
          + (f"; speed-up = (c) / (d) = {r['speedup']:.2f}x (medians: {r['speedup_median']:.2f}x)"
             if r["speedup"] else "")
          + (f"; over one serial worker = (c) / (d') = {r['speedup_serial']:.2f}x "
             f"(medians: {r['speedup_serial_median']:.2f}x)" if r.get("speedup_serial") else ""), flush=True)

