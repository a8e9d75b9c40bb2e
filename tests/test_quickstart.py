"""README's quick start, run as written at a small size.

The one fenced block under "## Quick start" runs in `bash -e` in a fresh folder, with the sizes it reads from the
environment shrunk (`ANSWERS`, `TOKENS`, `STEPS`, `PROMPTS`) and `TARGET` set to the session's real target
(SmolLM2-135M-Instruct: nothing is downloaded); a user runs the same lines at their defaults. The folder links the
checkout's `configs/`, as the block runs from the checkout. Asserted on what it leaves: the target's answers (one
per prompt, its own token ids), the run's last record at step STEPS, the export loading as a drafter of the
recipe's shape (`configs/real_smollm2.yaml`), and eval's JSON: every prompt decoded, checked lossless with no
mismatch, tau a number >= 1. About a minute on 2 cores (2 minutes measured under a load of 8).
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
SIZES = {"ANSWERS": 8, "TOKENS": 16, "STEPS": 10, "PROMPTS": 2}  # the block's defaults: 192, 32, 800, 16

pytestmark = pytest.mark.timeout(900)


def quick_start_block() -> str:
    """The bash block of README's "## Quick start" section (the only one there)."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start[^\n]*\n(.*?)(?=^## |\Z)", readme, flags=re.S | re.M)
    assert section, "README has no '## Quick start' section"
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), flags=re.S | re.M)
    assert len(blocks) == 1, f"the quick start must be one bash block, found {len(blocks)}"
    return blocks[0]


def test_the_block_takes_its_sizes_from_the_environment():
    """Each size the test shrinks is a `${NAME:-default}` of the block, so the test runs the user's lines."""
    block = quick_start_block()
    missing = [name for name in (*SIZES, "TARGET") if "${" + name + ":-" not in block]
    assert not missing, missing


def test_quick_start_runs_as_written(real_target: Path, tmp_path: Path):
    from dflash_ds.models.drafter import DFlashDrafter

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, **{k: str(v) for k, v in SIZES.items()}, "TARGET": str(real_target),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           # One thread, as every launched rank in the suite: its forwards are tiny, and two threads on cores
           # that others share spin against each other (eval took 110 s a prompt so under load 8, 8 s with one).
           "OMP_NUM_THREADS": "1"}
    r = run_bounded(["bash", "-e", "-c", quick_start_block()], 800, cwd=tmp_path, env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-8000:]}"

    answers = [json.loads(line) for line in (tmp_path / "prompts/train_answers.jsonl").read_text().splitlines()]
    assert len(answers) == SIZES["ANSWERS"]
    assert all(0 < len(row["token_ids"][0]) <= SIZES["TOKENS"] for row in answers), answers[0]

    run = tmp_path / "runs/smollm2"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == SIZES["STEPS"], records[-1]

    export = run / "checkpoints" / (run / "checkpoints/latest").read_text().strip() / "export"
    drafter = DFlashDrafter.from_pretrained(export)
    assert (drafter.arch.block_size, drafter.arch.num_hidden_layers, drafter.arch.mask_token_id) == (4, 2, 16)

    result = json.loads((run / "eval.json").read_text())
    assert result["drafter"] == str(export.relative_to(tmp_path)), result["drafter"]
    assert result["num_prompts"] == SIZES["PROMPTS"] and result["max_new_tokens"] == SIZES["TOKENS"], result
    assert result["lossless_checked"] and result["mismatches"] == [], result["mismatches"]
    assert 0 < result["generated_tokens"] <= SIZES["PROMPTS"] * SIZES["TOKENS"], result
    assert isinstance(result["tau"], float) and result["tau"] >= 1.0, result["tau"]
    print(f"quick start at {SIZES}: held-out tau {result['tau']:.3f} over {result['decode_steps']} steps")
