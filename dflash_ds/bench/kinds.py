"""`dflash-ds bench kinds`: every drafter kind x depth x seed on one target's own answers, held-out tau per budget.

The real-target table (docs/QUALITY.md "The kinds on a real target"): the same prompts, answers, drafter shape
(`--layers`, `--block-size`), steps, batch, anchors, learning rate and seeds for each kind, each kind's own
objective as its recipe sets it (`load_config` with `model.kind`, the kind's `recipe` in models/kinds.py: what
`train` would train). Every run is evaluated at each `--steps` budget (0 = the untrained drafter) by real speculative decoding on the same held-out
prompts: `eval`'s decoder (eval/speculative.py, HF engine, greedy), every output checked against the target's
greedy answer (made once, OUT/references.json; a differing output stops the bench).

Data: `make-prompts`' natural prompts split by `--prompt-seed` (whole topics held out), the target's own greedy
answers to the first `--train-prompts` (`regenerate`, kept in OUT/answers.jsonl and resumed).

Training runs in this process from the target's features, computed once per depth (tiny/context_check.py:
`target_states`, then `train_drafter`: the real objective, components/objective.py, AdamW with the trainer's
warmup + cosine schedule), not through `dflash-ds train`: an online CPU run of a 135M target spends its time in
the target's forward (a colocated run measured 53 tok/s, 67 s a step of 2 x 2,048 tokens). On a GPU the same
command runs the whole table in one process. What it costs: the features are [prompts, longest, depth x H] fp32
(192 x 120 x 5 x 576 x 4 B = 265 MB for SmolLM2 at 5 layers; a Qwen3-8B target (H 4096) at the same size would
need 1.9 GB: use fewer prompts or shorter answers there), plus the final hidden for a kind whose loss reads the
target's distribution (192 x 120 x 576 x 4 B = 53 MB). On this project's 2-core CPU (SmolLM2, one thread): a
2-layer DFlash step of 4 x 8 anchors in blocks of 4 takes 0.35 s, and one evaluation of 16 held-out prompts x 32
tokens ~50 s (evaluation, not training, dominates a CPU table: 64 prompts at 3 budgets x 18 runs is ~8 h).

Each result (kind, layers, seed, steps) is one JSON under OUT/runs/; a rerun reads finished ones back, so a
killed bench continues; OUT/settings.json keeps what the results depend on and a rerun under other settings
stops, naming what differs. The table (mean ± sd over seeds, per seed, P(position 1 accepted), label tokens
trained, seconds) is printed and written to OUT/table.md and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError

SETTINGS = ("target", "kinds", "layers", "seeds", "steps", "train_prompts", "held_out", "prompt_seed",
            "answer_tokens", "eval_tokens", "batch", "anchors", "block_size", "lr", "mask_token_id")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one value, none negative")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model folder (e.g. `make real-target`'s SmolLM2)")
    parser.add_argument("--out", default="bench_out/kinds", help="answers, results, table (default bench_out/kinds)")
    parser.add_argument("--kinds", default=None, help="comma-separated drafter kinds (default: every registered one)")
    parser.add_argument("--layers", type=_ints, default=[2, 5], help="drafter depths (default 2,5)")
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="drafter seeds (default 0,1,2)")
    parser.add_argument("--steps", type=_ints, default=[0, 400, 800], help="budgets in AdamW steps: each run "
                        "trains to the largest and is evaluated at each (0 = untrained; default 0,400,800)")
    parser.add_argument("--train-prompts", type=int, default=192, help="training prompts the target answers "
                        "(default 192)")
    parser.add_argument("--held-out", type=int, default=64, help="held-out prompts evaluated (default 64)")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the natural prompts' train/held-out "
                        "split (default 0)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens per training answer (default 32)")
    parser.add_argument("--eval-tokens", type=int, default=32, help="tokens generated per held-out prompt "
                        "(default 32)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--anchors", type=int, default=8, help="anchor blocks per sequence per step (default 8)")
    parser.add_argument("--block-size", type=int, default=4, help="block size of every drafter (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of every run (default 3e-3)")
    parser.add_argument("--mask-token-id", type=int, default=None, help="the drafters' MASK id (default: "
                        "init-drafter's choice; SmolLM2 has no mask token: 16, <empty_output>)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    parser.add_argument("--keep-exports", action="store_true", help="also save each run's drafter at each budget "
                        "as an export (OUT/runs/<run>/step<N>/: config.json + model.safetensors), e.g. for `bench "
                        "speedup`; 31 MB a 2-layer SmolLM2 drafter in float32")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each worker a process of its "
                        "own with the target and features (one thread each on CPU; on a GPU several share it: "
                        "evaluation is launch-bound there; default 1)")


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Write OUT/settings.json, or refuse a folder whose results were made under other settings."""
    path = out / "settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        differ = sorted(k for k in SETTINGS if k not in ("kinds", "layers", "seeds", "steps")
                        and old.get(k) != settings.get(k))
        if differ:
            raise DFlashError(f"{path}: results made with other settings ({', '.join(differ)}: "
                              f"{[old.get(k) for k in differ]} now {[settings.get(k) for k in differ]}); "
                              f"use another --out")
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".settings.json.tmp")
    tmp.write_text(json.dumps(settings, indent=1))
    tmp.replace(path)


def prepare_data(args: argparse.Namespace, out: Path) -> None:
    """The split (OUT/train.jsonl, OUT/held_out.jsonl), then the target's own answers (OUT/answers.jsonl)."""
    from dflash_ds.data.prompt_grid import natural_prompts, split_prompts, write_jsonl
    from dflash_ds.data.regenerate import regenerate

    train, held = split_prompts(natural_prompts(seed=args.prompt_seed), seed=args.prompt_seed,
                                held_out=args.held_out)
    if len(train) < args.train_prompts:
        raise DFlashError(f"--train-prompts {args.train_prompts}: the split leaves {len(train)} training prompts")
    write_jsonl(train[: args.train_prompts], out / "train.jsonl")
    write_jsonl(held, out / "held_out.jsonl")
    regenerate(args.target, out / "train.jsonl", out / "answers.jsonl", batch_size=32,
               max_new_tokens=args.answer_tokens)


def read_data(args: argparse.Namespace, out: Path) -> tuple[list[tuple[list[int], list[int]]], list[list[int]]]:
    """(training (prompt, answer) id pairs, held-out prompt ids) from what `prepare_data` wrote."""
    from dflash_ds.eval.cli import load_prompts

    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    answers = {}
    for line in (out / "answers.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["id"]] = row["token_ids"][0]
    prompts = load_prompts(out / "train.jsonl", args.target, len(rows))
    return (list(zip(prompts, [answers[r["id"]] for r in rows])),
            load_prompts(out / "held_out.jsonl", args.target, args.held_out))


def load_context(args: argparse.Namespace, out: Path, device: str, target=None, threads: int = 0) -> dict[str, Any]:
    """What a run needs, in this process: the target, the data, the features of each depth, the references."""
    import torch

    from dflash_ds.models.target import load_target
    from dflash_ds.tiny.context_check import target_states
    from dflash_ds.tools.init_drafter import drafter_arch_from_target

    if threads:
        torch.set_num_threads(threads)
    target = target if target is not None else load_target(args.target, device=device)
    seqs, held = read_data(args, out)
    states = {}
    for layers in args.layers:
        arch = drafter_arch_from_target(args.target, num_layers=layers, block_size=args.block_size,
                                        mask_token_id=args.mask_token_id)
        states[layers] = target_states(target, seqs, arch.target_layer_ids)  # on the target's device
    return {"args": args, "out": out, "target": target, "seqs": seqs, "held": held, "states": states,
            "references": references(target, held, args.eval_tokens, out), "device": device}


def kind_setup(kind: str, args: argparse.Namespace, layers: int):
    """(options, loss config) a run of `kind` trains with: its recipe under the bench's shape, as `train` would."""
    from dflash_ds.config import load_config
    from dflash_ds.models.kinds import kind_spec

    cfg = load_config(overrides={"model": {"kind": kind, "num_layers": layers, "block_size": args.block_size},
                                 "loss": {"num_anchors": args.anchors}})
    return kind_spec(kind).options_from_model(cfg.model), cfg.loss


def references(target, held: list[list[int]], max_new_tokens: int, out: Path) -> list[list[int]]:
    """The target's greedy answers to the held-out prompts: made once (OUT/references.json), each run's outputs are
    checked against them (half of what evaluating a drafter would cost if every evaluation decoded them again)."""
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate

    path = out / "references.json"
    key = {"prompts": held, "max_new_tokens": max_new_tokens}
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept["references"]
    eos = eos_token_ids(target)
    refs = [greedy_generate(target, p, max_new_tokens, eos) for p in held]
    tmp = path.with_name(".references.json.tmp")
    tmp.write_text(json.dumps({"key": key, "references": refs}))
    tmp.replace(path)
    return refs


def result_path(out: Path, kind: str, layers: int, seed: int, steps: int) -> Path:
    return out / "runs" / f"{kind}-L{layers}-s{seed}" / f"step{steps}.json"


def one_run(ctx: dict[str, Any], kind: str, layers: int, seed: int) -> list[dict[str, Any]]:
    """Train one drafter to the largest budget, evaluating it at each; each result written as it is made."""
    import torch

    from dflash_ds.tiny.context_check import AblationConfig, held_out_tau, train_drafter

    args, out, target = ctx["args"], ctx["out"], ctx["target"]
    budgets = sorted(set(args.steps))
    options, loss_cfg = kind_setup(kind, args, layers)
    cfg = AblationConfig(steps=max(max(budgets), 1), batch=args.batch, num_anchors=args.anchors, num_layers=layers,
                         block_size=args.block_size, lr=args.lr, seed=seed, mask_token_id=args.mask_token_id)
    results: list[dict[str, Any]] = []
    clock = {"start": time.perf_counter(), "cpu": time.process_time(), "eval": 0.0, "eval_cpu": 0.0}

    def at(step: int, drafter, labels, loss) -> None:
        if step not in budgets:
            return
        path = result_path(out, kind, layers, seed, step)
        if path.is_file():
            results.append(json.loads(path.read_text()))
            return
        t0, c0 = time.perf_counter(), time.process_time()
        drafter.eval()
        with torch.no_grad():  # raises where an output differs from the target's greedy one
            r = held_out_tau(target, drafter, ctx["held"], ctx["references"], args.eval_tokens)
        drafter.train()
        clock["eval"] += time.perf_counter() - t0
        clock["eval_cpu"] += time.process_time() - c0
        res = {"kind": kind, "layers": layers, "seed": seed, "steps": step, "label_tokens": int(labels),
               "loss": None if loss is None else float(loss),
               "tau": r["tau"], "tau_pooled": r.get("tau_pooled"),
               "acceptance": r["per_position_acceptance"],
               "train_s": round(time.perf_counter() - clock["start"] - clock["eval"], 1),
               "train_cpu_s": round(time.process_time() - clock["cpu"] - clock["eval_cpu"], 1),
               "eval_s": round(time.perf_counter() - t0, 1),
               "parameters": sum(p.numel() for p in drafter.parameters()), "device": ctx["device"]}
        path.parent.mkdir(parents=True, exist_ok=True)
        if args.keep_exports:
            drafter.save_pretrained(path.with_suffix(""))  # before the result: a result on disk means both are
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(path)
        results.append(res)
        print(f"bench kinds: {kind} L{layers} seed {seed} step {step}: held-out tau {res['tau']:.3f} "
              f"({res['train_s']:.0f} s training)", flush=True)

    if all(result_path(out, kind, layers, seed, s).is_file() for s in budgets):
        return [json.loads(result_path(out, kind, layers, seed, s).read_text()) for s in budgets]
    init = out / "init" / f"{kind}-L{layers}-s{seed}"  # the seeded untrained export train_drafter starts from
    train_drafter(target, args.target, ctx["seqs"], cfg, init, options=options, loss_cfg=loss_cfg,
                  states=ctx["states"][layers], on_step=at)
    shutil.rmtree(init, ignore_errors=True)  # 15-90 MB a run at SmolLM2's width: nothing reads it again
    return results


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, layers, steps): tau over seeds (mean, sample sd, per seed), P(pos 1), tokens, seconds."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kind"], r["layers"], r["steps"]), []).append(r)
    rows = []
    for (kind, layers, steps), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        taus = [r["tau"] for r in rs]
        p1 = [(r["acceptance"] or [0.0])[0] for r in rs]
        rows.append({"kind": kind, "layers": layers, "steps": steps, "seeds": [r["seed"] for r in rs],
                     "tau_mean": statistics.fmean(taus), "tau_sd": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                     "taus": taus, "p1_mean": statistics.fmean(p1),
                     "label_tokens": statistics.fmean(r["label_tokens"] for r in rs),
                     "train_s": statistics.fmean(r["train_s"] for r in rs),
                     "train_cpu_s": statistics.fmean(r["train_cpu_s"] for r in rs)})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kind | layers | steps | label tokens | held-out tau (mean ± sd) | per seed | P(pos 1) | train s (cpu s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['layers']} | {r['steps']} | {r['label_tokens']:,.0f} | "
                     f"{r['tau_mean']:.3f} ± {r['tau_sd']:.3f} | {' '.join(f'{t:.3f}' for t in r['taus'])} | "
                     f"{r['p1_mean']:.2f} | {r['train_s']:.0f} ({r['train_cpu_s']:.0f}) |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash_ds.models.kinds import kind_names
    from dflash_ds.models.target import load_target

    kinds = args.kinds.split(",") if args.kinds else kind_names()
    unknown = [k for k in kinds if k not in kind_names()]
    if unknown:
        raise DFlashError(f"--kinds: unknown {unknown}; registered: {', '.join(kind_names())}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.jobs < 1 or args.batch < 1 or args.anchors < 1 or args.block_size < 2:
        raise DFlashError("--jobs, --batch and --anchors must be >= 1, --block-size >= 2")
    out = Path(args.out)
    settings = {**{k: getattr(args, k) for k in SETTINGS}, "target": str(Path(args.target).resolve()),
                "kinds": kinds}
    check_settings(out, settings)
    for kind in kinds:  # a kind whose config cannot take the bench's shape fails here, before any answer is made
        kind_setup(kind, args, max(args.layers))
    prepare_data(args, out)
    target = load_target(args.target, device=device)
    seqs, held = read_data(args, out)
    print(f"bench kinds: {len(seqs)} training answers, {len(held)} held-out prompts, {len(kinds)} kinds x "
          f"layers {args.layers} x seeds {args.seeds}, budgets {sorted(set(args.steps))} on {device}", flush=True)
    references(target, held, args.eval_tokens, out)  # made once, here, before any worker reads them
    todo = [(k, n, s) for k in kinds for n in args.layers for s in args.seeds]
    if args.jobs == 1:
        ctx = load_context(args, out, device, target)
        results = [r for run_ in todo for r in one_run(ctx, *run_)]
    else:  # spawned (CUDA cannot be forked): each worker loads the target and makes the features once
        del target
        threads = 1 if device == "cpu" else 0
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=_start_worker,
                                 initargs=(args, out, device, threads)) as pool:
            results = [r for rs in pool.map(_worker_run, todo) for r in rs]
    rows = summarize(results)
    table = format_table(rows)
    (out / "table.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps({"settings": settings, "rows": rows, "runs": results}, indent=1))
    print(table)
    print(f"bench kinds: table -> {out / 'table.md'}, summary -> {out / 'summary.json'}",
          file=sys.stderr, flush=True)
    return 0


_CTX: dict[str, Any] = {}


def _start_worker(args: argparse.Namespace, out: Path, device: str, threads: int) -> None:
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import threading

    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), daemon=True, name="bench-parent").start()
    _CTX.update(load_context(args, out, device, threads=threads))


def _leave_with_parent(parent: int) -> None:
    """A worker whose bench was killed (SIGTERM, a deadline) ends within a second instead of training on for an
    hour as an orphan (seen: two 5-layer runs kept both cores busy); the results it wrote stay for the resume."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_run(run_: tuple[str, int, int]) -> list[dict[str, Any]]:
    return one_run(_CTX, *run_)
