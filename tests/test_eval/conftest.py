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
