"""`dflash-ds bench recipe`: which training recipe reaches the highest held-out acceptance, beyond the seed spread?

A recipe is a name and a set of config overrides (a YAML list, `--recipes FILE`):

    - name: ce_decay            # today's default
      set: {}
    - name: kl
      set: {loss.kl_weight: 0.5}

Every recipe trains, for every seed, on the same target, prepared data, steps and token budget, from a
fresh drafter initialised with that seed (`train.seed`), colocated on this machine (`--ranks` ranks
under torchrun, each with the target and the drafter); its export is then evaluated on the same held-out
prompts by real speculative decoding (`dflash-ds eval`'s `evaluate`: greedy, lossless-checked). The
table gives per recipe the held-out tau (mean over prompts of each prompt's mean, and pooled) as mean
and spread over seeds, P(position k accepted), training tokens and wall time, and the difference to the
first recipe, marked where the seed ranges do not overlap. Runs live in OUT/<recipe>/seed<S>/; a
finished run leaves result.json and is not run again, an interrupted one resumes from its checkpoint
(`--resume auto`), so a killed bench continues where it stopped. `--temperature T` > 0 evaluates by
speculative sampling instead (the same sampling seeds for every run), drafting the drafter's argmax as
serving engines do by default (`--draft-sample greedy`) or sampling the draft (`probabilistic`); its
results sit beside the greedy ones (result_t<T>.json, or result_t<T>_prob.json for sampled drafts; the
summary and plot likewise), so another temperature reuses the trained runs (trained.json records a
finished training). Each run folder keeps the settings its
result depends on (settings.json); a bench that finds a run made under other settings (an edited recipe,
other steps, data or prompts) stops before anything runs and names what differs, instead of mixing results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_ds.bench.recipe_table import format_table, plot, summarize
from dflash_ds.bench.recipe_warm import warm_flags
from dflash_ds.errors import DFlashError

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def override_flags(overrides: dict[str, Any]) -> list[str]:
    """{"loss.kl_weight": 0.5} -> ["--loss.kl_weight", "0.5"] (the trainer's command-line form)."""
    return [item for key, value in overrides.items() for item in (f"--{key}", _flag_value(value))]


def read_recipes(path: str | Path, config: str | None = None, shared: list[str] = ()) -> list[dict[str, Any]]:
    """The recipe list, each checked with the base config and shared overrides before anything runs."""
    import yaml

    from dflash_ds.config import load_config

    try:
        recipes = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DFlashError(f"--recipes {path}: cannot read ({str(exc).splitlines()[0]})") from None
    if not isinstance(recipes, list) or not recipes:
        raise DFlashError(f"--recipes {path}: expected a non-empty YAML list of {{name, set}} entries")
    seen: set[str] = set()
    for i, r in enumerate(recipes):
        where = f"--recipes {path}: entry {i + 1}"
        if not isinstance(r, dict) or set(r) - {"name", "set", "from"} or "name" not in r:
            raise DFlashError(f"{where}: expected {{name: ..., set: {{section.key: value}}, from: (optional, "
                              f"bench/recipe_warm.py)}}, got {r!r}")
        name, overrides = str(r["name"]), r.get("set") or {}
        if not NAME.match(name) or name in seen:
            raise DFlashError(f"{where}: name {name!r} must be unique and use only letters, digits, _ . -")
        if not isinstance(overrides, dict):
            raise DFlashError(f"{where} ({name}): 'set' must be a mapping of section.key: value")
        try:
            load_config(config, [*shared, *override_flags({str(k): v for k, v in overrides.items()})])
        except DFlashError as exc:
            raise DFlashError(f"{where} ({name}): {exc}") from None
        seen.add(name)
        r["name"], r["set"] = name, {str(k): v for k, v in overrides.items()}
    return recipes


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) or value is None else str(value)


def train_command(args: argparse.Namespace, recipe: dict, seed: int, run_dir: Path) -> list[str]:
    """The torchrun command of one (recipe, seed) run: colocated, the bench's shared settings, then the recipe's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
           "-m", "dflash_ds.train"]
    if args.config:
        cmd += ["--config", str(args.config)]
    cmd += ["--target", str(args.target), "--data", str(args.data), "--output-dir", str(run_dir),
            "--max-steps", str(args.steps), "--topology.colocate", "true", "--train.seed", str(seed),
            "--train.save_interval", str(args.save_interval), "--wandb.enabled", "false"]
    return cmd + shared_flags(args.set) + override_flags(recipe["set"]) + warm_flags(recipe, seed, run_dir)


def shared_flags(items: list[str]) -> list[str]:
    """--set KEY=VALUE items as trainer flags."""
    flags = []
    for item in items:
        if "=" not in item:
            raise DFlashError(f"--set {item!r}: expected KEY=VALUE, e.g. data.token_budget=2048")
        key, _, value = item.partition("=")
        flags += [f"--{key}", value]
    return flags


def suffix(temperature: float, draft_sample: str = "greedy") -> str:
    """"" for greedy evaluation, "_t<T>" for sampling at T ("_t<T>_prob" with sampled drafts): the name part of
    its result, summary and plot files."""
    if temperature <= 0:
        return ""
    return f"_t{temperature:g}" + ("_prob" if draft_sample == "probabilistic" else "")


def result_mode(result: dict) -> tuple[float, str | None]:
    """(temperature, draft sampling) a result file was evaluated with; files from before the draft rule was
    recorded sampled their drafts (the only rule then)."""
    t = float(result.get("temperature", 0.0))
    return t, (result.get("draft_sample", "probabilistic") if t > 0 else None)


def train_once(args: argparse.Namespace, recipe: dict, seed: int, run_dir: Path) -> tuple[dict, Path]:
    """Train (or resume) one run; {train_wall_s, train_cpu_s} and the export of its last checkpoint. The CPU
    seconds (user + system of the training process and every rank it waited for, os.wait4) do not depend on what
    else the machine runs, as wall seconds do: with 1 thread a rank they are the wall time an idle core would take."""
    trained = run_dir / "trained.json"
    if trained.is_file():  # finished by an earlier bench (e.g. evaluated at another temperature)
        record = json.loads(trained.read_text())
        return {k: record[k] for k in ("train_wall_s", "train_cpu_s") if k in record}, run_dir / record["export"]
    print(f"bench recipe: {recipe['name']} seed {seed}: training {args.steps} steps (log {run_dir / 'train.log'})",
          flush=True)
    log = run_dir / "train.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.Popen(train_command(args, recipe, seed, run_dir), stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        _, raw, usage = os.wait4(proc.pid, 0)
        proc.returncode = status = os.waitstatus_to_exitcode(raw)
    wall = time.perf_counter() - t0
    if status != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise DFlashError(f"recipe {recipe['name']} seed {seed}: training exited with status {status}; "
                          f"last lines of {log}:\n{tail}")
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    export = Path("checkpoints") / latest / "export"
    times = {"train_wall_s": round(wall, 1), "train_cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}
    trained.with_suffix(".tmp").write_text(json.dumps({**times, "export": str(export)}) + "\n")
    os.replace(trained.with_suffix(".tmp"), trained)
    return times, run_dir / export


def train_metrics(run_dir: Path) -> dict[str, Any]:
    """Tokens trained on and the last record's training-time acceptance figures."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1] if records else {}
    return {"train_tokens": int(sum(r.get("real_tokens", 0) for r in records)),
            **{f"train_{k}": last[k] for k in ("tau", "est_tau", "accuracy", "alpha", "alpha_tau", "argmax_alpha",
                                                  "argmax_alpha_tau") if k in last}}


# The evaluations share the target, whose capture hooks are the evaluating session's: one at a time (seen: two
# at once crossed each other's captured states). Training, the bulk of a run, is a process of its own.
_EVAL_LOCK = threading.Lock()


def run_settings(args: argparse.Namespace, recipe: dict, seed: int) -> dict[str, Any]:
    """What one run's result depends on (not --threads, --jobs or --save-interval: resume is exact)."""
    def where(path: Any) -> str | None:
        return None if path is None else str(Path(path).resolve())

    return {"target": where(args.target), "data": where(args.data), "config": where(args.config),
            "set": list(args.set), "recipe": recipe["set"], "seed": seed, "steps": args.steps, "ranks": args.ranks,
            "eval_data": where(args.eval_data), "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, **({"from": recipe["from"]} if recipe.get("from") else {})}


def check_settings(run_dir: Path, settings: dict[str, Any]) -> None:
    """A run folder made under other settings is an error naming each difference (its results would mix in)."""
    path = run_dir / "settings.json"
    if not path.is_file():
        return
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DFlashError(f"{path}: unreadable ({exc}); remove {run_dir} to rerun it") from None
    diff = [f"{key}: {before.get(key)!r} then, {settings[key]!r} now" for key in settings
            if before.get(key) != json.loads(json.dumps(settings[key]))]
    if diff:
        raise DFlashError(f"{run_dir} was run under other settings ({'; '.join(diff)}): use another --out, "
                          f"or remove that folder to rerun it")


def run_one(args, recipe, seed, target, prompts) -> dict[str, Any]:
    """Train and evaluate one (recipe, seed), or read its result file if an earlier bench finished it."""
    from dflash_ds.eval.cli import evaluate
    from dflash_ds.models.drafter import DFlashDrafter

    run_dir = Path(args.out) / recipe["name"] / f"seed{seed}"
    done = run_dir / f"result{suffix(args.temperature, args.draft_sample)}.json"
    mode = (float(args.temperature), args.draft_sample if args.temperature > 0 else None)
    if done.is_file():
        earlier = json.loads(done.read_text())
        if result_mode(earlier) == mode:
            print(f"bench recipe: {recipe['name']} seed {seed}: done before ({done})", flush=True)
            return earlier
        print(f"bench recipe: {recipe['name']} seed {seed}: {done} was evaluated with {result_mode(earlier)}, not "
              f"{mode}: evaluating again", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = run_dir / "settings.json"
    if not settings.is_file():
        settings.with_suffix(".tmp").write_text(json.dumps(run_settings(args, recipe, seed), indent=2) + "\n")
        os.replace(settings.with_suffix(".tmp"), settings)
    train_times, export = train_once(args, recipe, seed, run_dir)
    drafter = DFlashDrafter.from_pretrained(export).eval()
    with _EVAL_LOCK:
        t0 = time.perf_counter()
        res = evaluate(target, drafter, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=0, log=lambda _s: None, draft_sample=args.draft_sample)
        eval_wall = time.perf_counter() - t0
    if res["mismatches"]:
        raise DFlashError(f"recipe {recipe['name']} seed {seed}: speculative output differs from greedy decoding")
    result = {"recipe": recipe["name"], "seed": seed, "overrides": recipe["set"], "steps": args.steps,
              "temperature": args.temperature, **({"draft_sample": args.draft_sample} if args.temperature > 0 else {}),
              "tau": res["tau"], "tau_pooled": res["tau_pooled"], "decode_steps": res["decode_steps"],
              "per_position_acceptance": res["per_position_acceptance"], **train_metrics(run_dir),
              **train_times, "eval_wall_s": round(eval_wall, 1),
              "export": str(export)}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, done)  # the result file is whole or absent: a killed bench reruns only this eval
    print(f"bench recipe: {recipe['name']} seed {seed}: held-out tau {res['tau']:.3f} (pooled "
          f"{res['tau_pooled']:.3f})", flush=True)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench recipe flags."""
    parser.add_argument("--recipes", required=True, help="YAML list of {name, set: {section.key: value}}; the first "
                        "is the baseline the others are compared with")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--data", required=True, help="prepared dataset folder (dflash-ds prepare) to train on")
    parser.add_argument("--eval-data", required=True, help="held-out prompts: a .jsonl conversation file or a "
                        "prepared folder (as dflash-ds eval --data)")
    parser.add_argument("--config", default=None, help="base run config every recipe starts from (e.g. configs/tiny.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every recipe (before the recipe's own), repeatable")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run (default 300)")
    parser.add_argument("--save-interval", type=int, default=100, help="checkpoint interval of every run (default 100)")
    parser.add_argument("--ranks", type=int, default=1, help="colocated ranks per run (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each training rank and of the eval "
                        "(default 1: on a shared CPU, more threads than free cores make small matmuls spin, measured "
                        "80x slower decoding under load)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1): their trainings side by side, "
                        "their evaluations one at a time; a training takes ranks x --threads cores, so on a machine "
                        "of C free cores use jobs x ranks x threads <= C")
    parser.add_argument("--num-prompts", type=int, default=16, help="held-out prompts evaluated (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy evaluation, lossless-checked "
                        "(default); T > 0 = speculative sampling at T with the same seeds for every run. Results, "
                        "summary and plot of T > 0 are kept beside the greedy ones (*_t<T>.*), the trained runs "
                        "are reused")
    parser.add_argument("--draft-sample", choices=["greedy", "probabilistic"], default="greedy", help="with "
                        "--temperature > 0: greedy (default) drafts the argmax, as vLLM and SGLang serve by default; "
                        "probabilistic samples the draft (vLLM's draft_sample_method probabilistic)")
    parser.add_argument("--out", default="bench_out/recipe", help="runs, results and the plot (default bench_out/recipe)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object (last line)")


def run(args: argparse.Namespace) -> int:
    """Train and evaluate every (recipe, seed) not done yet; print the table; write the summary and the plot."""
    import torch

    from dflash_ds.eval.cli import load_prompts
    from dflash_ds.models.target import load_target

    recipes = read_recipes(args.recipes, args.config, shared_flags(args.set))
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise DFlashError(f"--seeds {args.seeds!r}: expected comma-separated integers") from None
    if not seeds or args.steps < 1 or args.ranks < 1 or args.jobs < 1:
        raise DFlashError("--seeds needs at least one seed; --steps, --ranks and --jobs must be >= 1")
    if not args.temperature >= 0:
        raise DFlashError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    out = Path(args.out)
    pairs = [(r, seed) for r in recipes for seed in seeds]
    for r, seed in pairs:  # every reused run checked before anything runs
        check_settings(out / r["name"] / f"seed{seed}", run_settings(args, r, seed))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.eval_data, args.target, args.num_prompts)
    target = load_target(args.target)
    t0 = time.perf_counter()
    # Runs are independent (each trains in its own process; the evaluations only read the shared target):
    # --jobs of them at once, results in table order whatever order they finish in.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda pair: run_one(args, *pair, target, prompts), pairs))
    rows = summarize(recipes, results)
    summary = {"recipes": rows, "runs": results, "seeds": seeds, "steps": args.steps, "num_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
               **({"draft_sample": args.draft_sample} if args.temperature > 0 else {}), "wall_s": round(time.perf_counter() - t0, 1)}
    name = suffix(args.temperature, args.draft_sample)
    summary_path, plot_path = out / f"summary{name}.json", out / f"tau{name}.png"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, results, plot_path, args.temperature)
    table = format_table(rows, recipes[0]["name"], args.temperature, args.draft_sample)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(summary))
    else:
        print(table)
        print(f"bench recipe: summary -> {summary_path}, plot -> {plot_path}")
    return 0
