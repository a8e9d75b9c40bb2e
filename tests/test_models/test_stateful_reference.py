"""Decoding the stateful families against a reference that shares no cache code with eval.

Qwen3.5 (Gated DeltaNet: a recurrent state folded token by token) and gpt-oss (sliding windows of 8 that
wrap) keep caches that eval cannot cut back: it snapshots, restores and replays them (`TargetSession`).
The reference here is an argmax loop over full `use_cache=False` forwards of the whole sequence, so a
wrong restore, a replay at the wrong position or a window that wraps wrongly shows up as a different token.
"""

from __future__ import annotations

import pytest
import torch

from dflash_ds.eval.speculative import greedy_generate, speculative_generate
from dflash_ds.models.target import load_target
from dflash_ds.tiny.families import make_tiny_family

BS = 4
NEW = 24


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def prompt_ids(path, rows) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dflash_ds.tiny.context_check import encode_prompts

    return encode_prompts(AutoTokenizer.from_pretrained(str(path)), rows)


def argmax_loop(target, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward of the whole sequence without a cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_stateful_family_decodes_as_full_forwards(family, tmp_path):
    from dflash_ds.tiny.context_check import AblationConfig, train_drafter
    from dflash_ds.tiny.corpus import tiny_prompts
    from dflash_ds.tools.init_drafter import init_drafter

    path = make_tiny_family(tmp_path / family, family)
    target = load_target(path)
    prompts = prompt_ids(path, tiny_prompts(2))
    assert min(len(p) for p in prompts) > 8  # past gpt-oss's window: the sliding cache wraps in the prefill
    references = [argmax_loop(target, p, NEW) for p in prompts]
    for prompt, reference in zip(prompts, references):
        assert greedy_generate(target, prompt, NEW, []) == reference

    # A drafter briefly trained on these very answers gets them partly right: partial blocks are accepted, so the
    # cache is restored and the accepted tokens replayed (a random target's answers do not generalise).
    cfg = AblationConfig(steps=30, batch=2, num_anchors=32, num_layers=1, block_size=BS)
    trained = train_drafter(target, path, list(zip(prompts, references)), cfg, tmp_path / "trained")
    random_drafter = init_drafter(path, tmp_path / "random", num_layers=1, block_size=BS).eval()
    lengths = []
    for prompt, reference in zip(prompts, references):
        for drafter in (random_drafter, trained):
            for budget in (None, 2 * (BS - 1)):
                out = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=NEW, eos_ids=[],
                                           tree_budget=budget)
                assert out.tokens == reference, (drafter is trained, budget)
                if drafter is trained and budget is None:
                    lengths += out.accept_lengths
                    assert out.replay_forwards == sum(1 for n in out.accept_lengths if n < BS)
    assert any(1 < n < BS for n in lengths)  # restored, then accepted tokens replayed
