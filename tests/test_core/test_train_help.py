"""`python -m dflash_ds.train --help` lists every config field (flag, doc, default); parsing is unchanged."""

import dataclasses
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from dflash_ds.config import Config, field_docs

REPO = Path(__file__).resolve().parents[2]
ALIASES = ["--config", "--target", "--data", "--drafter", "--output-dir", "--max-steps", "--seed", "--resume",
           "--zero-stage", "--ds-config", "--global-batch", "--gamma", "--num-target-ranks", "--targets-per-node",
           "--wandb-project", "--wandb-run-name", "--no-wandb", "--colocate"]


@lru_cache(maxsize=None)
def help_text(columns: str) -> str:
    env = {**os.environ, "COLUMNS": columns}
    r = subprocess.run([sys.executable, "-m", "dflash_ds.train", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def norm(text: str) -> str:
    return " ".join(text.split())


def default_of(dotted: str):
    obj = Config()
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("columns", ["60", "200"])
def test_help_lists_every_field_with_doc_and_default(columns):
    text = norm(help_text(columns))
    docs = field_docs()
    assert len(docs) > 50
    missing = []
    for dotted, doc in docs.items():
        m = re.search(rf"(?<![\w.-])--{re.escape(dotted)} \S+ {re.escape(norm(doc))} \(default: (.*?)\)(?: |$)",
                      text)
        if m is None:
            missing.append(dotted)
            continue
        shown = m.group(1)
        assert yaml.safe_load(shown) == default_of(dotted), (dotted, shown)
    assert not missing, missing


def test_help_groups_fields_by_section():
    text = help_text("100")
    sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name))]
    assert sections == ["model", "loss", "optim", "noise", "data", "train", "topology", "wandb"]
    positions = [text.index(f"config section {s} (") for s in sections]
    assert positions == sorted(positions)
    assert "config top-level fields" in text
    for s in sections:  # every field of a section sits between its header and the next one
        block = text[text.index(f"config section {s} ("):]
        nxt = re.search(r"\n\S", block[1:])
        block = block[:nxt.start() + 1] if nxt else block
        for f in dataclasses.fields(getattr(Config(), s)):
            assert f"--{s}.{f.name} " in block, (s, f.name)


def test_help_still_lists_the_short_flags():
    text = help_text("100")
    for flag in ALIASES:
        assert re.search(rf"^\s+{re.escape(flag)}\b", text, re.M), flag
    assert "--max-steps MAX_STEPS" in text and "[--train.max_steps]" in norm(text)


def test_overrides_and_short_flags_still_parse():
    from dflash_ds.errors import DFlashError
    from dflash_ds.train import config_from_args

    cfg = config_from_args(["--max-steps", "7", "--optim.lr", "3e-4", "--train.seed=4", "--no-wandb",
                            "--model.target_layer_ids", "[1, 2]", "--loss.kl_weight", "0.5", "--gamma", "3"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 3e-4 and cfg.train.seed == 4 and not cfg.wandb.enabled
    assert cfg.model.target_layer_ids == [1, 2] and cfg.loss.kl_weight == 0.5 and cfg.loss.gamma == 3.0
    assert config_from_args(["--max-steps", "7", "--train.max_steps", "9"]).train.max_steps == 9  # dotted wins
    assert config_from_args(["--optim.lr", "-1e-4", "--optim.lr", "1e-3"]).optim.lr == 1e-3
    assert config_from_args(["--colocate"]).topology.colocate
    with pytest.raises(DFlashError, match="did you mean 'gamma'"):
        config_from_args(["--loss.gam", "3"])  # dotted flags are not argparse options: no prefix matching
    with pytest.raises(DFlashError, match="optim.lr = -0.0001 must be > 0"):
        config_from_args(["--optim.lr", "-1e-4"])


def test_help_needs_no_torch():
    code = ("import sys\nfrom dflash_ds.train import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, 'deepspeed' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "TORCH False False" in r.stderr, r.stderr[-3000:]
    assert "--optim.lr FLOAT" in r.stdout
