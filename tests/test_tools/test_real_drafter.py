"""real-drafter's recipe file, its refusals and its summary, by hand; the stages themselves run end to end in
tests/test_quickstart.py (README's quick start is `make real-drafter` at a small size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ds.errors import DFlashError
from dflash_ds.tools.real_drafter import Runner, load_recipe, optional_flags, stage_settings
from dflash_ds.tools.real_drafter_summary import format_summary, tau_by_kind

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "real_drafter.yaml"


def test_recipe_file_and_overrides():
    r = load_recipe(RECIPE, ["prompts.count=12", "train.set.loss.num_anchors=4", "speedup.concurrency='1'"])
    assert r["prompts"]["count"] == 12 and r["train"]["set"]["loss.num_anchors"] == 4
    assert r["speedup"]["concurrency"] == "1"
    assert Path(r["train"]["config"]) == ROOT / "configs" / "real_smollm2.yaml"  # relative to the recipe file
    with pytest.raises(DFlashError, match="has no setting prompts.cont"):
        load_recipe(RECIPE, ["prompts.cont=12"])
    with pytest.raises(DFlashError, match="expected section.key=value"):
        load_recipe(RECIPE, ["prompts.count"])
    with pytest.raises(DFlashError, match="nope is not a section"):
        load_recipe(RECIPE, ["nope.count=1"])


def test_the_speedups_optional_settings():
    """speedup.draft_tokens and vllm_threads: null is the bench's default and the same stage as a recipe without the
    key (a run from before them resumes); set, they reach the bench's command line."""
    plain = load_recipe(RECIPE, [])
    assert plain["speedup"]["draft_tokens"] is None and optional_flags(plain["speedup"], "draft_tokens") == []
    older = {**plain, "speedup": {k: v for k, v in plain["speedup"].items() if k not in ("draft_tokens",
                                                                                           "vllm_threads")}}
    assert stage_settings(older, "/t")["speedup"] == stage_settings(plain, "/t")["speedup"]
    r = load_recipe(RECIPE, ["speedup.draft_tokens='3,7'", "speedup.vllm_threads=2"])
    assert optional_flags(r["speedup"], "draft_tokens", "vllm_threads") == ["--draft-tokens", "3,7",
                                                                            "--vllm-threads", "2"]
    assert stage_settings(r, "/t")["speedup"] != stage_settings(plain, "/t")["speedup"]


def test_recipe_without_a_section_or_config(tmp_path):
    (tmp_path / "r.yaml").write_text("prompts: {}\n")
    with pytest.raises(DFlashError, match="no section 'answers'"):
        load_recipe(tmp_path / "r.yaml", [])
    text = RECIPE.read_text().replace("config: real_smollm2.yaml", "config: missing.yaml")
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(DFlashError, match="train.config 'missing.yaml': no such file"):
        load_recipe(tmp_path / "r.yaml", [])


def test_a_finished_stage_with_other_settings_is_refused(tmp_path, capsys):
    settings = stage_settings(load_recipe(RECIPE, []), "/t")
    runner = Runner(tmp_path, settings)
    runner.run("prepare", [["true"]])
    assert runner.done("prepare") and json.loads((tmp_path / "stages/prepare.json").read_text())["settings"] == \
        settings["prepare"]
    runner.run("prepare", [["false"]])  # done: not run again (`false` would fail)
    assert "prepare: done" in capsys.readouterr().out
    changed = stage_settings(load_recipe(RECIPE, ["prepare.max_length=64"]), "/t")
    with pytest.raises(DFlashError, match=r"the prepare stage ran with max_length = 512, the recipe now says 64"):
        Runner(tmp_path, changed).check()
    with pytest.raises(DFlashError, match=r"the train stage failed \(exit 1\): false"):
        Runner(tmp_path, changed).run("train", [["false"]])
    assert not (tmp_path / "stages/train.json").exists()


def test_tau_by_task_type_and_the_summary(tmp_path):
    rows = [{"kind": k, "messages": []} for k in ("fact", "code", "fact", "math")]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # eval took the first 3 prompts; the second had no decode step
    assert tau_by_kind(tmp_path / "p.jsonl", {"tau_per_prompt": [2.0, None, 1.5]}) == {"fact": 1.75}
    summary = {"export": "E", "prompts": {"requests": 10, "kept": 8, "rejected": {}, "train": 7}, "answer_tokens": 900,
               "train_steps": 5, "held_out": {"held_out": {"tau": 1.75, "tau_pooled": 1.7, "prompts": 3,
                                                          "p_position": [0.5, 0.2, 0.1], "by_kind": {"fact": 1.75}}},
               "speedup": [{"engine": "vllm", "concurrency": 1, "draft_tokens": 7, "tau": 1.7, "step_ratio": 1.25,
                            "predicted_speedup": 1.36, "speedup": 1.3, "speedup_min": 1.2, "speedup_max": 1.4,
                            "plain_tok_s": 15.0, "spec_tok_s": 19.5}],
               "mismatches": 0, "wall_s": {"prompts": 60.0, "train": 120.0, "eval": None}, "total_s": 180.0}
    text = format_summary(summary)
    assert "8 generated prompts kept of 10 asked, 7 training prompts, 900 answer tokens; 5 training steps" in text
    assert "tau held_out (3 prompts): 1.750 (pooled 1.700; P(pos 1-3) 0.50, 0.20, 0.10); by task type: fact 1.75" in text
    assert "speedup vllm at concurrency 1, k 7: 1.30x (1.20-1.40; 15.0 -> 19.5 tok/s, tau 1.70, predicted 1.36x from " \
           "step ratio 1.25)" in text
    assert "minutes: prompts 1.0, train 2.0; total 3.0" in text


STAGE = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, _frame):
    (out / "stage_got").write_text(str(signum))
    sys.exit(75)  # what the trainer does after its checkpoint
signal.signal(signal.SIGTERM, stop)
(out / "stage_pid").write_text(str(os.getpid()))
time.sleep(120)
"""
DRIVER = """
import sys
from pathlib import Path
from dflash_ds.errors import DFlashError
from dflash_ds.tools.real_drafter import Runner
out = Path(sys.argv[1])
try:
    Runner(out, {"train": {}}).run("train", [[sys.executable, "-c", sys.argv[2], str(out)]])
except DFlashError as exc:
    sys.exit(f"error: {exc}")
"""


def test_a_sigterm_reaches_the_running_stage_and_the_recipe_stops_resumable(tmp_path):
    """`kill` (or a scheduler's SIGTERM) on real-drafter goes on to the stage it runs (the trainer then checkpoints)
    and the recipe stops with the stage unfinished, nothing left running; before, the stage ran on, orphaned."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), STAGE], stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "stage_pid").is_file():
            assert time.monotonic() < deadline and proc.poll() is None, "the stage did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "error: the train stage was stopped by SIGTERM (it exited 75; a train stage checkpoints first)" in err, err
    assert (tmp_path / "stage_got").read_text() == str(int(signal.SIGTERM))
    pid = int((tmp_path / "stage_pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stage is gone (and reaped: no zombie answers)
    assert not (tmp_path / "stages" / "train.json").exists()  # not done: the next run resumes it
