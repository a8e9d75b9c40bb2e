"""Fixtures shared by the eval tests: the tiny target loaded once, chat prompts, a random drafter."""

from __future__ import annotations

import pytest
import torch

BS = 8  # drafter block size in the eval tests


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny forwards on a shared 2-core machine: extra threads only contend.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def target(tiny_target):
    from dflash_ds.models.target import load_target

    return load_target(tiny_target)


@pytest.fixture(scope="session")
def prompts(tiny_target):
    from transformers import AutoTokenizer

    from dflash_ds.tiny.corpus import tiny_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
             for r in tiny_prompts(3)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="session")
def random_drafter(tiny_target, tmp_path_factory):
    from dflash_ds.tools.init_drafter import init_drafter

    return init_drafter(tiny_target, tmp_path_factory.mktemp("eval") / "drafter", num_layers=2, block_size=BS).eval()


@pytest.fixture(scope="session")
def trained_drafter(tiny_target, target, tmp_path_factory):
    """40 AdamW steps of the real objective on the target's own greedy answers to 8 other prompts."""
    from transformers import AutoTokenizer

    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate
    from dflash_ds.tiny.context_check import AblationConfig, encode_prompts, train_drafter
    from dflash_ds.tiny.corpus import tiny_prompts

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    train = encode_prompts(tok, tiny_prompts(8, seed=5))  # other prompts than the evaluated ones
    seqs = [(p, greedy_generate(target, p, 48, eos_token_ids(target))) for p in train]
    cfg = AblationConfig(steps=40, batch=8, num_anchors=16, num_layers=2, block_size=BS, seed=1)
    return train_drafter(target, tiny_target, seqs, cfg, tmp_path_factory.mktemp("eval") / "trained")


@pytest.fixture(scope="session")
def quality_target(tmp_path_factory):
    """The quality target (tiny/quality.py) at its defaults, trained once per test run (~90 s on 2 AVX2 cores), by
    whichever worker needs it first (conftest.built_once)."""
    from build_once import built_once
    from dflash_ds.tiny.quality import make_quality_target

    return built_once(tmp_path_factory, "quality_target", make_quality_target)
