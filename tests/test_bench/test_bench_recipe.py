"""`dflash-ds bench recipe` on 2 recipes x 1 seed x 4 steps: the table's fields, the per-run results, the
plot, a killed bench (one result missing) continuing with only what is missing, `bench curve` over the runs'
checkpoints, and an edited recipe stopped before it mixes with the runs made before the edit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
from runtime_utils import REPO, make_dataset  # noqa: E402

RECIPES = """\
- name: ce_decay
  set: {}
- name: kl_lk
  set: {loss.kl_weight: 0.5, loss.lk: hybrid, loss.lk_weight: 0.5}
"""


def bench(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ds.cli", "bench", "recipe", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


@pytest.mark.timeout(600)  # 4-5 min on 2 loaded cores: 3 trainings, 6 evaluations
def test_bench_recipe_table_results_and_resume(tiny_target, tmp_path: Path, cli_here) -> None:
    from dflash_ds.tiny.corpus import tiny_prompts

    data = make_dataset(tiny_target, tmp_path / "prepared", n=48, max_length=256, block_size=8)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in tiny_prompts(3, seed=11)))
    (tmp_path / "recipes.yaml").write_text(RECIPES)
    out = tmp_path / "out"
    args = ["--recipes", str(tmp_path / "recipes.yaml"), "--target", str(tiny_target), "--data", str(data),
            "--eval-data", str(held), "--config", str(REPO / "configs/tiny.yaml"), "--seeds", "3", "--steps", "4",
            "--save-interval", "2", "--num-prompts", "3", "--max-new-tokens", "16", "--out", str(out),
            "--set", "data.token_budget=1024", "--set", "train.log_interval=1", "--json"]
    r = bench([*args, "--jobs", "2"])  # both runs at once; below, kl_lk again from scratch and alone
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert [x["recipe"] for x in summary["recipes"]] == ["ce_decay", "kl_lk"]
    for row in summary["recipes"]:
        runs = [x for x in summary["runs"] if x["recipe"] == row["recipe"]]
        assert row["seeds"] == [3] and len(runs) == 1 and runs[0]["steps"] == 4
        assert row["tau_mean"] == runs[0]["tau"] >= 1.0 and row["tau_std"] == 0.0
        assert row["tau_pooled_mean"] == runs[0]["tau_pooled"] and len(row["per_position_acceptance"]) == 7
        assert row["train_tokens"] > 0 and row["train_wall_s"] > 0 and "train_tau" in row
        # CPU seconds of the training process and the ranks it waited for: torch's import alone is seconds a process
        assert row["train_cpu_s"] == runs[0]["train_cpu_s"] > 2.0
        assert Path(runs[0]["export"], "model.safetensors").is_file()
    base, other = summary["recipes"]
    assert other["vs_baseline"] == pytest.approx(other["tau_mean"] - base["tau_mean"])
    assert base["beyond_spread"] is False and other["overrides"] == {"loss.kl_weight": 0.5, "loss.lk": "hybrid",
                                                                   "loss.lk_weight": 0.5}
    assert base["train_tokens"] == other["train_tokens"]  # same data, steps and budget for every recipe
    assert "alpha" in json.loads((out / "kl_lk/seed3/metrics.jsonl").read_text().splitlines()[-1])  # LK trained
    assert "ce_decay" in r.stderr and "vs ce_decay" in r.stderr  # the table
    assert (out / "tau.png").stat().st_size > 1000

    # A killed bench whose kl_lk run left nothing (killed before its first checkpoint): only that run is redone,
    # trained from scratch and alone (--jobs 1); it trains as it did beside ce_decay under --jobs 2, step for step,
    # and the summary is the same.
    assert json.loads((out / "kl_lk/seed3/trained.json").read_text())["export"].endswith("export")
    losses_jobs2 = [m["loss"] for m in map(json.loads, (out / "kl_lk/seed3/metrics.jsonl").read_text().splitlines())]
    shutil.rmtree(out / "kl_lk/seed3")
    r = bench([*args, "--jobs", "1"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "ce_decay seed 3: done before" in r.stdout and "kl_lk seed 3: training 4 steps" in r.stdout
    losses_jobs1 = [m["loss"] for m in map(json.loads, (out / "kl_lk/seed3/metrics.jsonl").read_text().splitlines())]
    assert losses_jobs1 == losses_jobs2 and len(losses_jobs1) == 4, (losses_jobs1, losses_jobs2)  # every step
    again = json.loads(r.stdout.strip().splitlines()[-1])
    for a, b in zip(again["runs"], summary["runs"]):
        assert (a["tau"], a["tau_pooled"], a["train_tokens"]) == (b["tau"], b["tau_pooled"], b["train_tokens"])

    # Sampling at T=1 on the same runs: no training again, results beside the greedy ones, which stay as they were.
    # (This and what follows run in this process: the command's start is shown above.)
    r = cli_here("bench", "recipe", *args, "--temperature", "1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "training" not in r.stdout and "speculative sampling at temperature 1" in r.stderr
    sampled = json.loads(r.stdout.strip().splitlines()[-1])
    assert sampled == json.loads((out / "summary_t1.json").read_text()) and sampled["temperature"] == 1.0
    assert (out / "tau_t1.png").stat().st_size > 1000 and json.loads((out / "summary.json").read_text()) == again
    base_t1, kl_lk_t1 = sampled["recipes"]  # alpha_tau only where the loss read the target's distribution
    assert "train_alpha_tau" not in base_t1 and 1.0 <= kl_lk_t1["train_alpha_tau"] <= 8.0
    assert 1.0 <= kl_lk_t1["train_argmax_alpha_tau"] <= 8.0  # and for the argmax drafted, the engines' default
    for a, b in zip(sampled["runs"], again["runs"]):
        assert a["temperature"] == 1.0 and a["tau"] >= 1.0 and a["export"] == b["export"]
        assert a["train_wall_s"] == b["train_wall_s"] and a["train_tokens"] == b["train_tokens"]
        assert a["train_cpu_s"] == b["train_cpu_s"]  # read back, not trained again
        assert a["draft_sample"] == "greedy"  # the engines' default draft rule
    # A result file from before the draft rule was recorded sampled its drafts: not reused for greedy drafts.
    old = json.loads((out / "kl_lk/seed3/result_t1.json").read_text())
    del old["draft_sample"]
    (out / "kl_lk/seed3/result_t1.json").write_text(json.dumps(old))
    r = cli_here("bench", "recipe", *args, "--temperature", "1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "ce_decay seed 3: done before" in r.stdout and "training" not in r.stdout
    assert "kl_lk seed 3: " + str(out / "kl_lk/seed3/result_t1.json") + " was evaluated with (1.0, 'probabilistic'), " \
        "not (1.0, 'greedy'): evaluating again" in r.stdout
    resampled = json.loads(r.stdout.strip().splitlines()[-1])
    assert resampled["recipes"] == sampled["recipes"]  # seeded: the same figures (train walls come from trained.json)
    for a, b in zip(resampled["runs"], sampled["runs"]):
        assert {**a, "eval_wall_s": 0} == {**b, "eval_wall_s": 0}  # the evaluation's wall time is measured anew

    # bench curve over both runs' kept checkpoints (steps 2 and 4): the step-4 point is the recipe's result (the same
    # export, prompts and tokens), tokens grow with the step, and a second call evaluates nothing again.
    curve_args = ["--runs", str(out / "ce_decay/seed3"), str(out / "kl_lk/seed3"), "--target", str(tiny_target),
                  "--eval-data", str(held), "--num-prompts", "3", "--max-new-tokens", "16", "--out", str(out / "curve"),
                  "--json"]
    r = subprocess.run([sys.executable, "-m", "dflash_ds.cli", "bench", "curve", *curve_args], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    curves = json.loads(r.stdout.strip().splitlines()[-1])["curves"]
    assert sorted(curves) == ["ce_decay/seed3", "kl_lk/seed3"]
    for run in again["runs"]:
        pts = curves[f"{run['recipe']}/seed3"]
        assert [p["step"] for p in pts] == [2, 4] and 0 < pts[0]["tokens"] < pts[1]["tokens"] == run["train_tokens"]
        assert pts[1]["tau"] == pytest.approx(run["tau"]) and pts[1]["tau_pooled"] == pytest.approx(run["tau_pooled"])
    kept = {p: p.stat().st_mtime_ns for p in out.glob("*/seed3/curve/step_*.json")}
    assert len(kept) == 4 and (out / "curve" / "curve.png").stat().st_size > 1000
    r = cli_here("bench", "curve", *curve_args)
    assert r.returncode == 0 and {p: p.stat().st_mtime_ns for p in kept} == kept, r.stderr[-3000:]

    # The recipe edited, the same --out: one clear error naming the run and the difference, before anything runs.
    (tmp_path / "recipes.yaml").write_text(RECIPES.replace("loss.lk_weight: 0.5", "loss.lk_weight: 0.25"))
    summary_text = (out / "summary.json").read_text()
    r = cli_here("bench", "recipe", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "kl_lk/seed3 was run under other settings" in r.stderr and "'loss.lk_weight': 0.25" in r.stderr, r.stderr
    assert "training" not in r.stdout and (out / "summary.json").read_text() == summary_text


def test_bench_recipe_rejects_a_bad_recipe_before_running(tiny_target, tmp_path: Path, cli_here) -> None:
    (tmp_path / "recipes.yaml").write_text("- name: a\n  set: {loss.kl_wieght: 0.5}\n")
    r = cli_here("bench", "recipe", "--recipes", tmp_path / "recipes.yaml", "--target", tiny_target, "--data", tmp_path,
                 "--eval-data", tmp_path, "--out", tmp_path / "out")
    assert r.returncode == 2 and "entry 1 (a)" in r.stderr and "kl_wieght" in r.stderr
    assert not (tmp_path / "out").exists()


def test_file_names_and_modes_of_sampled_evaluations() -> None:
    from dflash_ds.bench.recipe import result_mode, suffix

    assert [suffix(0.0), suffix(1.0), suffix(0.7, "probabilistic"), suffix(0.0, "probabilistic")] == \
        ["", "_t1", "_t0.7_prob", ""]
    assert result_mode({"temperature": 0.0}) == (0.0, None)
    assert result_mode({"temperature": 1.0}) == (1.0, "probabilistic")  # written before the rule was recorded
    assert result_mode({"temperature": 1.0, "draft_sample": "greedy"}) == (1.0, "greedy")


def test_table_lines_carry_each_recipes_figures() -> None:
    from dflash_ds.bench.recipe_table import format_table

    row = {"recipe": "base", "tau_mean": 2.5, "tau_std": 0.125, "tau_pooled_mean": 2.25, "tau_pooled_std": 0.0625,
           "vs_baseline": 0.0, "beyond_spread": False, "train_tokens": 1000, "train_wall_s": 12.4,
           "train_cpu_s": 20.6, "train_tau": 4.876, "train_est_tau": 3.214, "per_position_acceptance": [0.5, 0.25]}
    other = {**row, "recipe": "lk", "tau_mean": 1.75, "vs_baseline": -0.75, "beyond_spread": True}
    del other["train_est_tau"], other["train_cpu_s"]  # runs recorded before est_tau, CPU seconds
    header, base, lk, legend = format_table([row, other], "base").splitlines()
    assert header.split()[:4] == ["recipe", "tau", "pooled", "vs"] and "train tau" in header and "est_tau" in header
    assert base.split() == ["base", "2.500", "±0.125", "2.250", "±0.062", "+0.000", "1000", "12", "21", "4.88", "3.21",
                            "0.50", "0.25"]
    assert lk.split() == ["lk", "1.750", "±0.125", "2.250", "±0.062", "-0.750", "*", "1000", "12", "-", "4.88", "-",
                          "0.50", "0.25"]
    assert "seed ranges do not overlap with base's" in legend and "greedy (lossless-checked)" in legend
    # Sampled serving: the training column that predicts it is argmax_alpha_tau for argmax drafts (the engines'
    # default), alpha_tau for sampled ones, where the recipe logged it.
    row = {**row, "train_alpha_tau": 5.678, "train_argmax_alpha_tau": 4.321}
    header, base, lk, legend = format_table([row, other], "base", 1.0).splitlines()
    assert "argmax_alpha_tau" in header and "est_tau" not in header and "temperature 1 (greedy drafts)" in legend
    assert base.split()[9:11] == ["4.88", "4.32"] and lk.split()[10:12] == ["4.88", "-"]
    header, base, lk, legend = format_table([row, other], "base", 1.0, "probabilistic").splitlines()
    assert " alpha_tau" in header and "argmax" not in header and "(probabilistic drafts)" in legend
    assert base.split()[9:11] == ["4.88", "5.68"]
