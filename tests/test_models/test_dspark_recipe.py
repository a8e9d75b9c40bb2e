"""DSpark's recipe (config_recipe.py, models/dspark_arch.RECIPE): `model.kind: dspark` alone trains DeepSpec's
objective, whatever the run sets wins and is reported, `recipe: none` turns it off; the confidence head's target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_ds.config import load_config
from dflash_ds.config_recipe import recipe_report
from dflash_ds.errors import DFlashError

REPO = Path(__file__).resolve().parents[2]


def test_dspark_alone_trains_deepspecs_recipe(tmp_path: Path) -> None:
    cfg = load_config(None, ["--model.kind", "dspark"])
    assert cfg.recipe == "deepspec" and cfg.model.block_size == 8 and cfg.loss.gamma == 4.0
    assert (cfg.loss.lk, cfg.loss.lk_weight, cfg.loss.confidence_weight) == ("l1", 0.9, 1.0)
    assert cfg.loss.confidence_target == "sampled" and "keeps all of it" in recipe_report(cfg, "dspark")
    mine = load_config(REPO / "configs/tiny.yaml", ["--model.kind", "dspark", "--loss.gamma", "7"])
    assert mine.loss.gamma == 7.0 and mine.model.num_layers == 2 and mine.loss.lk == "l1"  # set fields win
    report = recipe_report(mine, "dspark")
    assert "WARNING" in report and "loss.gamma 7.0 (recipe 4.0)" in report and "model.num_layers 2" in report
    off = load_config(None, ["--model.kind", "dspark", "--recipe", "none"])
    assert off.recipe == "none" and off.loss.lk == "" and off.model.block_size == 16 and off.loss.gamma == 7.0
    assert "deepspec, is off" in recipe_report(off, "dspark")
    plain = load_config(None, [])
    assert plain.recipe == "none" and plain.loss.lk == "" and recipe_report(plain, "dflash").startswith("recipe: none")
    with pytest.raises(DFlashError, match="recipe = 'deepspec' is not a recipe of drafter kind 'dflash'"):
        load_config(None, ["--recipe", "deepspec"])
    with pytest.raises(DFlashError, match="loss.confidence_target = 'x' must be sampled or greedy"):
        load_config(None, ["--model.kind", "dspark", "--loss.confidence_target", "x"])
    # --drafter: the folder's kind picks the recipe; its shape stays the folder's (no model.* from the recipe)
    (tmp_path / "d").mkdir()
    (tmp_path / "d/config.json").write_text(json.dumps({"architectures": ["Qwen3DSparkModel"]}))
    warm = load_config(None, ["--drafter", str(tmp_path / "d")])
    assert warm.recipe == "deepspec" and warm.loss.lk == "l1" and warm.model.block_size == 16


def test_confidence_target_greedy_is_the_hit(tiny_target: Path) -> None:
    """loss.confidence_target greedy: the BCE's target is argmax == label (models/dspark_loss.py's mean error
    against its target reads 0 exactly when the head says the hit); sampled: alpha (a different value)."""
    from dflash_ds.components.objective import TargetStates, drafter_objective
    from dflash_ds.config import LossConfig
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.dspark_arch import DSparkOptions
    from dflash_ds.models.from_target import drafter_arch_from_target

    gen = torch.Generator().manual_seed(0)
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=4, options=DSparkOptions(markov_rank=4))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    v, h = arch.vocab_size, arch.hidden_size
    embed, head = torch.nn.Embedding(v, h), torch.nn.Linear(h, v, bias=False)
    ids = torch.randint(0, v, (1, 16), generator=gen)
    mask = torch.ones(1, 16, dtype=torch.long)
    context = torch.randn(1, 16, len(arch.target_layer_ids) * h, generator=gen)
    states = TargetStates(ids, mask, torch.tensor([16]), context, torch.randn(1, 16, h, generator=gen))
    out = {}
    for aim in ("sampled", "greedy"):
        cfg = LossConfig(gamma=4.0, num_anchors=3, lk="l1", lk_weight=0.9, confidence_target=aim)
        terms, sums = drafter_objective(drafter, embed, head, states, cfg, anchor_gen=torch.Generator().manual_seed(1))
        out[aim] = (float(sums["conf_loss_sum"]), terms)
    hit = out["greedy"][1].correct.float()[out["greedy"][1].valid]
    alpha = out["sampled"][1].alpha[out["sampled"][1].valid]
    assert not torch.allclose(hit, alpha)  # the two targets differ on this batch, and so do the BCE sums
    assert out["greedy"][0] != pytest.approx(out["sampled"][0])


def test_init_drafter_of_the_kind_takes_its_block(tiny_target: Path, tmp_path: Path) -> None:
    from dflash_ds.cli import main
    from dflash_ds.models.drafter import read_drafter_arch

    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "s"), "--kind", "dspark",
                 "--num-layers", "1"]) == 0
    assert read_drafter_arch(tmp_path / "s").block_size == 8  # the deepspec recipe's: 7 drafts
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "f"), "--num-layers", "1"]) == 0
    assert read_drafter_arch(tmp_path / "f").block_size == 16
