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


def test_dspark_alone_trains_deepspecs_recipe(tiny_target: Path, tmp_path: Path) -> None:
    cfg = load_config(None, ["--model.kind", "dspark"])
    assert cfg.recipe == "deepspec" and cfg.model.block_size == 8 and cfg.loss.gamma == 4.0
    assert (cfg.loss.lk, cfg.loss.lk_weight, cfg.loss.confidence_weight) == ("l1", 0.9, 1.0)
    assert "keeps all of it" in recipe_report(cfg, "dspark")
    # the confidence head aims at what vLLM's default serving accepts (greedy drafts), with the recipe and without
    from dflash_ds.models.dspark_arch import RECIPE, DSparkLoss

    assert cfg.loss.confidence_target == RECIPE["loss.confidence_target"] == DSparkLoss().confidence_target == "greedy"
    assert load_config(None, ["--model.kind", "dspark", "--recipe", "none"]).loss.confidence_target == "greedy"
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
    # ... and the report compares the folder's shape with the recipe's: a DSpark warm-started from a block-16,
    # 1-layer DFlash export says so; one of the recipe's shape keeps all of it
    from dflash_ds.models.dspark_arch import DSparkOptions
    from dflash_ds.models.from_target import drafter_arch_from_target

    folder = drafter_arch_from_target(tiny_target, num_layers=1, block_size=16, options=DSparkOptions(markov_rank=4))
    report = recipe_report(warm, "dspark", folder)
    assert "WARNING" in report and "model.block_size 16 (recipe 8; the --drafter folder's)" in report, report
    assert "model.num_layers 1 (recipe 5" in report and "model.markov_rank 4 (recipe 256" in report
    assert "model.enable_confidence_head" not in report and "loss." not in report
    same = drafter_arch_from_target(tiny_target, num_layers=5, block_size=8, options=DSparkOptions(),
                                    target_layer_ids=[0, 1, 2, 3, 3])
    assert "keeps all of it" in recipe_report(warm, "dspark", same)


def test_confidence_target_greedy_is_the_hit(tiny_target: Path) -> None:
    """loss.confidence_target greedy: the BCE's target is the top-1 hit, argmax == label (by hand, on hits where the
    top-4 one differs); sampled: alpha (a different value). Each is what the logged calibration judges."""
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
    # The kind's term by hand on given hits (a random drafter hits nothing at top-1): the BCE and the calibration
    # read the top-1 hit under greedy (not the top-4 one), alpha under sampled.
    from types import SimpleNamespace

    from dflash_ds.components.weights import decay_weights
    from dflash_ds.models.dspark_loss import loss_terms, metrics as confidence_metrics
    from dflash_ds.models.kinds import DraftedPositions

    n, k = 4, arch.block_size - 1
    at = DraftedPositions(torch.randn(n, k, h, generator=gen), torch.randint(0, v, (n, k), generator=gen),
                          torch.ones(n, k, dtype=torch.bool), torch.randint(0, v, (n,), generator=gen), head)
    top1 = torch.rand(n, k, generator=gen) < 0.3
    given = SimpleNamespace(correct=top1, in_top4=top1 | (torch.rand(n, k, generator=gen) < 0.5), valid=at.valid,
                            alpha=torch.rand(n, k, generator=gen))
    assert not torch.equal(given.correct, given.in_top4)
    with torch.no_grad():
        prev = torch.cat([at.anchor_ids[:, None], at.labels[:, :-1]], dim=1)
        conf = drafter.confidence_logits(at.hidden, drafter.markov_head.embed(prev))
        for aim, target in (("greedy", top1.float()), ("sampled", given.alpha)):
            cfg = LossConfig(gamma=4.0, confidence_target=aim)
            term, sums = loss_terms(drafter, at, cfg).finish(given)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, target, reduction="none")
            w = decay_weights(k, 4.0, conf.device).expand(n, k)
            assert float(term) == pytest.approx(float((bce * w).sum() / w.sum()), rel=1e-5), aim
            got, p = confidence_metrics({key: float(x) for key, x in sums.items()}), torch.sigmoid(conf)
            assert got["confidence_brier"] == pytest.approx(float(((p - target) ** 2).mean()), rel=1e-5), aim
            assert got["confidence_abs_error"] == pytest.approx(float((p - target).abs().mean()), rel=1e-5), aim


def test_init_drafter_of_the_kind_takes_its_block(tiny_target: Path, tmp_path: Path) -> None:
    from dflash_ds.cli import main
    from dflash_ds.models.drafter import read_drafter_arch

    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "s"), "--kind", "dspark",
                 "--num-layers", "1"]) == 0
    assert read_drafter_arch(tmp_path / "s").block_size == 8  # the deepspec recipe's: 7 drafts
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "f"), "--num-layers", "1"]) == 0
    assert read_drafter_arch(tmp_path / "f").block_size == 16
