"""README's quick start, run as written at a small size: `make real-drafter`, the whole pipeline on the real target.

The one fenced block under "## Quick start" runs in `bash -e` from the checkout (its Makefile), with the run folder
and a small recipe given through the Makefile's own variables (`RECIPE_OUT`, `RECIPE_ARGS`: `?=`, so the
environment sets them) and `REAL_TARGET` set to the session's target (SmolLM2-135M-Instruct: nothing is
downloaded; the `make install serve-env real-target` line finds everything built). The small recipe keeps every
stage: self-instruct and regenerate through one real vLLM server of the target, prepare, `dflash-ds train` under
torchrun, eval on both held-out sets, and `bench speedup` with our decoder (the vLLM side of the bench has its
own test, tests/test_serving/test_bench_speedup_vllm.py). Asserted on what it leaves: the prompts and their
stats, the target's answers, the run's last record, the export, tau per held-out set, the speedup rows and the
summary; then the same command resumes with nothing to do (no request asked again), and a changed setting of a
finished stage is refused before anything runs. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from proc_utils import run_bounded

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"prompts.count": 24, "prompts.held_out": 4, "prompts.grid_train": 24, "prompts.concurrency": 16, "answers.max_new_tokens": 24,
         "answers.concurrency": 16, "prepare.max_length": 256, "train.steps": 6, "train.set.train.save_interval": 6,
         "train.set.train.eval_interval": 6, "train.set.data.max_length": 256, "train.set.data.token_budget": 512,
         "eval.num_prompts": 2, "eval.max_new_tokens": 12, "speedup.num_prompts": 2, "speedup.max_new_tokens": 12,
         "speedup.concurrency": "1", "speedup.repeats": 1, "speedup.engine": "dflash"}

pytestmark = pytest.mark.timeout(1500)


def quick_start_block() -> str:
    """The bash block of README's "## Quick start" section (the only one there)."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start[^\n]*\n(.*?)(?=^## |\Z)", readme, flags=re.S | re.M)
    assert section, "README has no '## Quick start' section"
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), flags=re.S | re.M)
    assert len(blocks) == 1, f"the quick start must be one bash block, found {len(blocks)}"
    return blocks[0]


def test_the_block_is_the_makefile_route():
    """The block runs `make real-drafter`, whose run folder and settings come from variables the environment sets."""
    block = quick_start_block()
    assert re.search(r"^make real-drafter\b", block, flags=re.M), block
    makefile = (ROOT / "Makefile").read_text()
    for name in ("RECIPE_OUT", "RECIPE_ARGS", "REAL_TARGET"):
        assert re.search(rf"^{name} \?=", makefile, flags=re.M), name


def run_block(env: dict, args: dict) -> object:
    recipe_args = " ".join(f"--set {k}={v}" for k, v in args.items())
    return run_bounded(["bash", "-e", "-c", quick_start_block()], 1200, cwd=ROOT,
                       env={**env, "RECIPE_ARGS": recipe_args})


def test_quick_start_runs_as_written(real_target: Path, tmp_path: Path):
    out = tmp_path / "rd"
    env = {**os.environ, "RECIPE_OUT": str(out), "REAL_TARGET": str(real_target),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           # One thread, as every launched rank in the suite: its forwards are tiny, and two threads on cores
           # that others share spin against each other (eval took 110 s a prompt so under load 8, 8 s with one).
           "OMP_NUM_THREADS": "1"}
    r = run_block(env, SMALL)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-6000:]}\nstderr:\n{r.stderr[-8000:]}"

    stats = json.loads((out / "prompts/data_stats.json").read_text())
    assert stats["kept"] >= SMALL["prompts.count"] and stats["held_out"]["prompts"] >= 1, stats
    assert stats["requests"] == len((out / "prompts/generated.jsonl").read_text().splitlines())
    assert stats["requests"] == stats["kept"] + sum(stats["rejected"].values())
    train_prompts = (out / "prompts/train.jsonl").read_text().splitlines()
    answers = [json.loads(line) for line in (out / "answers/train.jsonl").read_text().splitlines()]
    assert len(answers) == len(train_prompts) == stats["train"]["prompts"]
    # prompts.grid_train: the grid's first 24 training prompts beside the generated ones
    assert stats["train"]["prompts"] == SMALL["prompts.grid_train"] + stats["generated_train"]["prompts"], stats
    assert all(0 < len(row["token_ids"][0]) <= SMALL["answers.max_new_tokens"] for row in answers), answers[0]

    records = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == SMALL["train.steps"], records[-1]
    # the recipe's model.init: target, said as the run starts (SmolLM2: 30 layers, the recipe's 2 draft layers)
    assert "the draft layers start as the target's layers 28-29 of 30 (model.init: target)" in r.stdout, r.stdout[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    export = Path(summary["export"])
    assert export == out / "run/checkpoints/step_00000006/export"
    assert (export.parent / "recipe.yaml").is_file() and (out / "recipe.yaml").is_file()
    from dflash_ds.models.drafter import DFlashDrafter

    assert DFlashDrafter.from_pretrained(export).arch.block_size == 8
    for name in ("held_out", "held_out_grid"):
        result = json.loads((out / f"eval/{name}.json").read_text())
        assert result["lossless_checked"] and result["mismatches"] == [], result["mismatches"]
        assert summary["held_out"][name]["tau"] == result["tau"] >= 1.0
        assert summary["held_out"][name]["by_kind"], summary["held_out"][name]
    speed = json.loads((out / "speedup/speedup.json").read_text())
    assert speed["mismatches"] == [] and [(r["engine"], r["concurrency"]) for r in speed["rows"]] == [("dflash", 1)]
    assert summary["speedup"][0]["speedup"] == speed["rows"][0]["speedup"]["mean"] > 0
    text = (out / "summary.txt").read_text()
    assert text in r.stdout and "speedup dflash at concurrency 1" in text

    # The same command again: every stage done, nothing asked of a server (no new raw request), the same summary.
    again = run_block(env, SMALL)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count(": done (") == 6 and "vllm: starting" not in again.stdout + again.stderr
    assert len((out / "prompts/generated.jsonl").read_text().splitlines()) == stats["requests"]
    assert text in again.stdout

    # A finished stage's setting changed: refused, naming it, before anything runs.
    changed = run_block(env, {**SMALL, "answers.max_new_tokens": 25})
    assert changed.returncode != 0
    assert "the answers stage ran with max_new_tokens = 24, the recipe now says 25" in changed.stderr, changed.stderr
    assert json.loads((out / "summary.json").read_text()) == summary
