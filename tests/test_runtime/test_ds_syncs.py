"""No device barrier in DeepSpeed's steps: the trainer's config turns off the throughput timer, which would
synchronize the device twice per micro-step (engine.forward and engine.step) from its third step on (a GPU
property, counted on the CPU by patching the accelerator's `synchronize`: tests/sync_count.py)."""

from __future__ import annotations

import json
import sys

from dflash_ds.config import load_config
from dflash_ds.runtime.engine import load_ds_config, resolve_ds_config
from proc_utils import run_bounded
from runtime_utils import REPO, env_for_children


def test_the_trainer_config_turns_the_throughput_timer_off() -> None:
    for stage in (1, 2, 3):
        cfg = load_config(None, {"train": {"zero_stage": stage}})
        ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=False)
        assert ds["timers"]["throughput"] == {"enabled": False, "synchronized": False}


def test_deepspeed_steps_do_not_synchronize_the_device_at_zero_1_2_3(tmp_path) -> None:
    r = run_bounded([sys.executable, str(REPO / "tests/test_runtime/_ds_sync_script.py"), str(tmp_path / "pg")], 300,
                    env=env_for_children(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # 6 micro-steps each, 2 per update; DeepSpeed's default timer: 2 barriers in each of micro-steps 4 and 5.
    assert got == {"zero1": 0, "zero2": 0, "zero3": 0, "zero1_default_timer": 4}, got
