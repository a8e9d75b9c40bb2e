"""`dflash-ds real-drafter` (`make real-drafter`): from nothing to a measured decode speedup, in one command.

Stages, each the command a user would type (printed before it runs), in OUT/:

    prompts   dflash-ds self-instruct          -> prompts/ (train, held_out, held_out_grid, data_stats.json)
    answers   dflash-ds regenerate (greedy)    -> answers/train.jsonl, answers/held_out.jsonl
    prepare   dflash-ds prepare                -> data/train, data/held_out
    train     python -m dflash_ds.train        -> run/ (checkpoints with exports, metrics.jsonl)
    eval      dflash-ds eval, each held-out set -> eval/held_out.json, eval/held_out_grid.json
    speedup   dflash-ds bench speedup          -> speedup/ (speedup.txt, .json, .png)

The prompts and answers stages share one vLLM server of the target (started once here). A stage that finished
leaves stages/<name>.json with the settings it ran with and its wall time, and is skipped when run again; one
that was cut short is run again and resumes inside (self-instruct's raw log, regenerate's kept rows, the
trainer's `--resume auto`). A finished stage whose settings differ from the recipe's is refused, naming the
setting, before anything runs. At the end: OUT/summary.txt and summary.json (the data, tau per held-out set and
task type, the speedup), and the recipe beside the export (OUT/recipe.yaml and <export>/../recipe.yaml).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from dflash_ds.errors import DFlashError

STAGES = ("prompts", "answers", "prepare", "train", "eval", "speedup")
HELD_SETS = ("held_out", "held_out_grid")


def load_recipe(path: str | Path, sets: list[str]) -> dict:
    """The recipe file with `--set section.key=value` overrides (values parsed as YAML); errors name the key."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"--recipe {path}: no such file")
    recipe = yaml.safe_load(path.read_text()) or {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DFlashError(f"--set {item!r}: expected section.key=value")
        parts = key.split(".")
        if parts[:2] == ["train", "set"] and len(parts) > 2:  # train.set holds the trainer's dotted keys
            parents, leaf = parts[:2], ".".join(parts[2:])
        else:
            parents, leaf = parts[:-1], parts[-1]
        node = recipe
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise DFlashError(f"--set {item!r}: {'.'.join(parents[:i + 1])} is not a section of {path}")
            node = node[part]
        if leaf not in node and parents != ["train", "set"]:
            raise DFlashError(f"--set {item!r}: {path} has no setting {key}")
        node[leaf] = yaml.safe_load(value)
    for section in ("prompts", "answers", "prepare", "train", "eval", "speedup"):
        if not isinstance(recipe.get(section), dict):
            raise DFlashError(f"{path}: no section '{section}'")
    config = Path(str(recipe["train"].get("config", ""))).expanduser()
    config = config if config.is_absolute() else (path.parent / config).resolve()  # relative to the recipe file
    if not config.is_file():
        raise DFlashError(f"{path}: train.config {recipe['train'].get('config')!r}: no such file ({config})")
    recipe["train"]["config"] = str(config)
    return recipe


def optional_flags(section: dict, *keys: str) -> list[str]:
    """`--key-name value` for each of `keys` the section sets (null or absent: the command's own default)."""
    return [x for k in keys if section.get(k) is not None for x in (f"--{k.replace('_', '-')}", str(section[k]))]


def stage_settings(recipe: dict, target: str) -> dict[str, dict]:
    """What each stage's result depends on (a stage is redone only when this changes, and then refused)."""
    seed = recipe.get("seed", 0)
    return {"prompts": {"target": target, "seed": seed, **recipe["prompts"]},
            "answers": {"target": target, **recipe["answers"]},
            "prepare": {**recipe["prepare"], "block_size": recipe["train"].get("set", {}).get("model.block_size")},
            "train": {"seed": seed, **recipe["train"]},
            "eval": dict(recipe["eval"]),
            # a null setting is one left out (a recipe written before the setting existed resumes unchanged)
            "speedup": {k: v for k, v in recipe["speedup"].items() if v is not None}}


def run_stage(cmd: list[str], grace_s: float = 600.0) -> tuple[int, bool]:
    """Run one stage's command; (its exit status, whether a SIGTERM stopped it). A SIGTERM to real-drafter (a
    scheduler's, `kill`, systemd's) goes on to the stage, so the trainer checkpoints and exits 75 as it does under
    a launcher, the generators keep the rows they finished, and nothing is left running behind the recipe (by
    default Python would die at once and leave the stage running on). On any other way out (Ctrl-C, which the
    stage also receives from the terminal) the stage gets `grace_s` to finish, then is killed."""
    proc = subprocess.Popen(cmd)
    stopped = []

    def forward(signum, _frame):
        stopped.append(signum)
        proc.send_signal(signum)

    main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    previous = signal.signal(signal.SIGTERM, forward) if main else None
    try:
        return proc.wait(), bool(stopped)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            try:
                proc.wait(timeout=grace_s)
            except BaseException:  # the grace ran out, or a second Ctrl-C
                proc.kill()
                proc.wait()


class Runner:
    """Runs the stages in OUT, skipping finished ones, timing each."""

    def __init__(self, out: Path, settings: dict[str, dict]) -> None:
        self.out, self.settings = out, settings
        (out / "stages").mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()

    def marker(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.json"

    def done(self, stage: str) -> bool:
        path = self.marker(stage)
        return path.is_file() and json.loads(path.read_text())["settings"] == self.settings[stage]

    def check(self) -> None:
        """Refuse a finished stage whose settings changed, before anything runs."""
        for stage in STAGES:
            path = self.marker(stage)
            if not path.is_file():
                continue
            old = json.loads(path.read_text())["settings"]
            new = self.settings[stage]
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if diff:
                k = diff[0]
                raise DFlashError(f"{self.out}: the {stage} stage ran with {k} = {old.get(k)!r}, the recipe now says "
                                  f"{new.get(k)!r}: use a new --out, or remove {path} and what the stage wrote")

    def run(self, stage: str, commands: list[list[str]]) -> None:
        if self.done(stage):
            print(f"real-drafter: {stage}: done ({self.marker(stage)})", flush=True)
            return
        start = time.perf_counter()
        print(f"real-drafter: {stage} (at {start - self.t0:,.0f} s)", flush=True)
        for cmd in commands:
            print("  $ " + shlex.join(cmd), flush=True)
            code, stopped = run_stage(cmd)
            if stopped:
                raise DFlashError(f"the {stage} stage was stopped by SIGTERM (it exited {code}; a train stage "
                                  f"checkpoints first): run the same command again to resume")
            if code != 0:
                raise DFlashError(f"the {stage} stage failed (exit {code}): {shlex.join(cmd)}; run the same command "
                                  f"again to resume")
        wall = time.perf_counter() - start
        tmp = self.marker(stage).with_suffix(".tmp")
        tmp.write_text(json.dumps({"settings": self.settings[stage], "wall_s": round(wall, 1)}, indent=1) + "\n")
        tmp.replace(self.marker(stage))
        print(f"real-drafter: {stage}: {wall:,.0f} s", flush=True)

    def wall(self, stage: str) -> float | None:
        path = self.marker(stage)
        return json.loads(path.read_text())["wall_s"] if path.is_file() else None


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "dflash_ds", *map(str, args)]


def latest_export(run: Path) -> Path:
    latest = run / "checkpoints" / "latest"
    if not latest.is_file():
        raise DFlashError(f"{run}: no checkpoint (checkpoints/latest) after training")
    export = run / "checkpoints" / latest.read_text().strip() / "export"
    if not (export / "config.json").is_file():
        raise DFlashError(f"{export}: the newest checkpoint has no export")
    return export


def served_stages(runner: Runner, recipe: dict, target: str, out: Path, vllm_python: str | None) -> None:
    """prompts and answers through one vLLM server of the target (started only if either stage is to run)."""
    if runner.done("prompts") and runner.done("answers"):
        runner.run("prompts", [])
        runner.run("answers", [])
        return
    from dflash_ds.serving.vllm_server import VLLMServer, generation_threads

    p, a = recipe["prompts"], recipe["answers"]
    (out / "logs").mkdir(exist_ok=True)
    with VLLMServer(target, python=vllm_python, seed=recipe.get("seed", 0), log_path=out / "logs" / "vllm_target.log",
                    max_model_len=2048, threads=generation_threads()) as server:
        url = server.url
        runner.run("prompts", [cli("self-instruct", "--target", target, "--out", out / "prompts", "--server", url,
                                   "--prompts", p["count"], "--held-out", p["held_out"], "--seed",
                                   recipe.get("seed", 0), "--concurrency", p["concurrency"],
                                   *([] if p.get("grid_train") is None else ["--grid-train", p["grid_train"]]))])
        runner.run("answers", [cli("regenerate", "--target", target, "--data", out / "prompts" / f"{name}.jsonl",
                                   "--out", out / "answers" / f"{name}.jsonl", "--server", url, "--max-new-tokens",
                                   a["max_new_tokens"], "--concurrency", a["concurrency"])
                               for name in ("train", "held_out")])


def run_recipe(recipe: dict, out: Path, recipe_path: Path, vllm_python: str | None) -> dict:
    target = str(Path(recipe["target"]).expanduser()) if recipe.get("target") else None
    if not target or not (Path(target) / "config.json").is_file():
        raise DFlashError(f"target {target!r}: not an HF model folder (set `target:` in the recipe or pass --target)")
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, stage_settings(recipe, target))
    runner.check()
    (out / "answers").mkdir(exist_ok=True)
    served_stages(runner, recipe, target, out, vllm_python)
    tr, ev, sp = recipe["train"], recipe["eval"], recipe["speedup"]
    block = tr.get("set", {}).get("model.block_size")
    prep = ["--block-size", block] if block else []
    runner.run("prepare", [cli("prepare", "--target", target, "--data", out / "answers" / f"{name}.jsonl", "--out",
                               out / "data" / name, "--max-length", recipe["prepare"]["max_length"], "--force", *prep)
                           for name in ("train", "held_out")])
    overrides = [x for k, v in tr.get("set", {}).items() for x in (f"--{k}", json.dumps(v) if not isinstance(v, str)
                                                                   else v)]
    runner.run("train", [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          "-m", "dflash_ds.train", "--config", tr["config"], "--target", target, "--data",
                          str(out / "data" / "train"), "--data.val_path", str(out / "data" / "held_out"),
                          "--output-dir", str(out / "run"), "--max-steps", str(tr["steps"]), "--seed",
                          str(recipe.get("seed", 0)), "--resume", "auto", "--no-wandb", *overrides]])
    export = latest_export(out / "run")
    runner.run("eval", [cli("eval", "--target", target, "--drafter", export, "--data", out / "prompts" /
                            f"{name}.jsonl", "--num-prompts", ev["num_prompts"], "--max-new-tokens",
                            ev["max_new_tokens"], "--json", out / "eval" / f"{name}.json") for name in HELD_SETS])
    runner.run("speedup", [cli("bench", "speedup", "--target", target, "--drafter", export, "--data",
                               out / "prompts" / "held_out.jsonl", "--num-prompts", sp["num_prompts"],
                               "--max-new-tokens", sp["max_new_tokens"], "--concurrency", sp["concurrency"],
                               "--repeats", sp["repeats"], "--engine", sp.get("engine", "auto"), "--out",
                               out / "speedup", *optional_flags(sp, "draft_tokens", "vllm_threads"))])
    shutil.copyfile(recipe_path, out / "recipe.yaml")
    (out / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    shutil.copyfile(out / "recipe.resolved.yaml", export.parent / "recipe.yaml")
    from dflash_ds.tools.real_drafter_summary import summarize, write_summary

    summary = summarize(out, export, {s: runner.wall(s) for s in STAGES})
    write_summary(out, summary)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the real-drafter flags."""
    parser.add_argument("--recipe", default="configs/real_drafter.yaml", help="the recipe file (default "
                        "configs/real_drafter.yaml): sizes of every stage")
    parser.add_argument("--out", default="runs/real-drafter", help="the recipe's folder (default runs/real-drafter): "
                        "every stage's output; running again resumes")
    parser.add_argument("--target", default=None, help="HF folder of the target (overrides the recipe's `target`)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change one recipe setting, repeatable (e.g. --set train.steps=200)")
    parser.add_argument("--vllm-python", default=None, help="Python of the environment vLLM is installed in "
                        "(default: $DFLASH_VLLM_PYTHON, else the repository's .venv-serve)")


def run(args: argparse.Namespace) -> int:
    """CLI entry: run (or resume) every stage; print the summary."""
    recipe = load_recipe(args.recipe, args.set)
    if args.target:
        recipe["target"] = args.target
    summary = run_recipe(copy.deepcopy(recipe), Path(args.out), Path(args.recipe), args.vllm_python)
    with contextlib.suppress(OSError):
        print((Path(args.out) / "summary.txt").read_text(), end="")
    return 0 if summary else 1
