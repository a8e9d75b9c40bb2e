"""configs/qwen3-8b.yaml's target:drafter split is what `dflash-ds plan` picks for 8 GPUs at the estimated rates
(issue #32: a target forward ~0.4 s, a drafter micro-step ~0.7 s per 16,384-token batch on an H200)."""

from pathlib import Path

from dflash_ds.config import load_config
from dflash_ds.plan.capacity import best_split

REPO = Path(__file__).resolve().parents[2]


def test_the_qwen3_8b_recipe_takes_plans_split_of_its_8_gpus() -> None:
    cfg = load_config(REPO / "configs" / "qwen3-8b.yaml")
    a, b = cfg.data.token_budget / 0.4, cfg.data.token_budget / 0.7  # 40,960 and 23,406 tok/s per rank
    split = best_split(8, 1, a, b)
    best = split["best"]
    assert (best["target_ranks"], best["drafter_ranks"]) == (3, 5) == (cfg.topology.num_target_ranks, 8 - 3)
    one_target = split["options"][0]  # what the recipe had: 1 target feeding 7 drafters
    assert one_target["target_ranks"] == 1 and best["tok_per_s"] / one_target["tok_per_s"] > 2.8  # 117k vs 41k
    text = (REPO / "configs" / "qwen3-8b.yaml").read_text()
    assert "--target-tok-per-s 40960 --drafter-tok-per-s 23406" in text  # the comment says where it came from
