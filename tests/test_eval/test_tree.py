"""Tree drafting: best-first construction, ancestor mask, cache gather, and lossless tree decoding."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_ds.eval.speculative import (TargetSession, eos_token_ids, greedy_generate, speculative_generate,
                                        summarize)
from dflash_ds.eval.tree import accept_path, ancestor_matrix, build_tree, tree_attention_mask

BS = 8  # drafter block size, as the random_drafter fixture (conftest.py)


@pytest.fixture
def drafter(random_drafter):
    return random_drafter


def _paths(tree) -> list[tuple[int, ...]]:
    """Token path from the root to every node."""
    out = []
    for i in range(len(tree.tokens)):
        path, j = [], i + 1
        while j:
            path.append(tree.tokens[j - 1])
            j = tree.parents[j - 1]
        out.append(tuple(reversed(path)))
    return out


def test_build_tree_is_the_top_budget_paths():
    lp = torch.log_softmax(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    # every path of every depth, scored by brute force
    every = {}
    for d in range(1, 4):
        for toks in itertools.product(range(4), repeat=d):
            every[toks] = sum(float(lp[k, t]) for k, t in enumerate(toks))
    ranked = sorted(every, key=lambda p: -every[p])
    for budget in (1, 5, 11, 30):
        tree = build_tree(lp, budget)
        assert len(tree.tokens) == budget
        assert set(_paths(tree)) == set(ranked[:budget])
        assert tree.scores == pytest.approx(sorted(tree.scores, reverse=True))  # placed best-first
        assert all(p < i + 1 for i, p in enumerate(tree.parents))  # parents precede children
        assert tree.depths == [len(p) for p in _paths(tree)]
    small, big = build_tree(lp, 5), build_tree(lp, 11)
    assert big.tokens[:5] == small.tokens and big.parents[:5] == small.parents  # nested across budgets


def test_build_tree_top1_is_the_greedy_chain_and_skips_impossible_tokens():
    lp = torch.log_softmax(torch.randn(BS - 1, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    chain = build_tree(lp, BS - 1, top_k=1)
    assert chain.tokens == lp.argmax(-1).tolist()
    assert chain.parents == list(range(BS - 1)) and chain.depths == list(range(1, BS))
    onehot = torch.full((3, 10), float("-inf"))
    onehot[torch.arange(3), torch.tensor([4, 7, 2])] = 0.0
    tree = build_tree(onehot, 16)  # only 3 possible nodes
    assert tree.tokens == [4, 7, 2] and tree.parents == [0, 1, 2]


def test_ancestor_mask_and_accept_path_by_hand():
    # root -> a(5) -> c(9); root -> b(6)
    parents = [0, 0, 1]
    anc = ancestor_matrix(parents)
    assert anc.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    mask = tree_attention_mask(parents, past_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6)
    assert (mask[0, 0, :, :2] == 0).all() and mask[0, 0, 3, 4] == torch.finfo(torch.float32).min
    from dflash_ds.eval.tree import DraftTree

    tree = DraftTree(tokens=[5, 6, 9], parents=parents, depths=[1, 1, 2], scores=[0, 0, 0])
    assert accept_path(tree, [5, 9, 0, 3]) == ([0, 1, 3], 3)  # root->a->c, then the bonus after c
    assert accept_path(tree, [6, 0, 1, 0]) == ([0, 2], 1)
    assert accept_path(tree, [7, 0, 0, 0]) == ([0], 7)


def test_tree_forward_and_gathered_cache_equal_sequential_decoding(target):
    from dflash_ds.eval.tree import verify_tree

    prefix = [11, 40, 7, 300, 25, 61]
    start = len(prefix)
    g = greedy_generate(target, prefix + [99], 3)  # what the target will accept after the anchor 99
    # Draft logits whose tree puts a wrong branch first and the target's path in the *second* branch,
    # so the accepted entries are not contiguous in the tree forward and the cache must gather them.
    wrong = (g[0] + 1) % 512
    logits = torch.full((3, 512), -20.0)
    logits[0, wrong], logits[0, g[0]] = 0.0, -0.5
    logits[1, g[1]] = 0.0
    logits[2, g[2]] = 0.0
    with TargetSession(target, [1]) as tgt:
        tgt.forward(prefix, torch.arange(start))
        accepted, bonus, feats = verify_tree(tgt, 99, logits, start, budget=8)
        kept = [(layer.keys.clone(), layer.values.clone()) for layer in tgt.cache.layers]
    assert accepted == g
    with TargetSession(target, [1]) as ref:  # plain causal decoding of the accepted path
        seq = prefix + [99] + accepted
        ref_logits, ref_feats = ref.forward(seq, torch.arange(len(seq)))
    assert bonus == int(ref_logits[-1].argmax())
    assert torch.allclose(feats, ref_feats[start:], atol=1e-5)
    for (k, v), layer in zip(kept, ref.cache.layers):
        assert k.shape == layer.keys.shape
        assert torch.allclose(k, layer.keys, atol=1e-5) and torch.allclose(v, layer.values, atol=1e-5)
    # and every tree node's logits equal those of sequential decoding of its own path
    tree = build_tree(torch.log_softmax(logits, -1), 6)
    with TargetSession(target, []) as tgt:
        tgt.forward(prefix, torch.arange(start))
        mask = tree_attention_mask(tree.parents, start, torch.float32)
        tree_logits, _ = tgt.forward([99] + tree.tokens, start + torch.tensor([0] + tree.depths), mask=mask)
    for i, path in enumerate(_paths(tree)):
        with TargetSession(target, []) as ref:
            seq = prefix + [99] + list(path)
            assert torch.allclose(tree_logits[i + 1], ref.forward(seq, torch.arange(len(seq)))[0][-1], atol=1e-4)


def test_top1_tree_equals_single_path(target, prompts, drafter):
    eos = eos_token_ids(target)
    for prompt in prompts[:2]:
        chain = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=16, eos_ids=eos)
        tree = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=16, eos_ids=eos,
                                    tree_budget=BS - 1, tree_top_k=1)
        assert tree.tokens == chain.tokens and tree.accept_lengths == chain.accept_lengths
    # the same with acceptances: an oracle right for 3 positions, then wrong
    greedy = greedy_generate(target, prompts[0], 24, eos)
    seq = prompts[0] + greedy + [0] * BS

    def oracle(_ctx, _block, start):
        want = seq[start + 1: start + BS]
        return torch.tensor([t if k < 3 else (t + 1) % 512 for k, t in enumerate(want)])

    tree = speculative_generate(target, prompts[0], draft_fn=oracle, block_size=BS, max_new_tokens=24, eos_ids=eos,
                                tree_budget=BS - 1, tree_top_k=1)
    assert tree.tokens == greedy[:24] and set(tree.accept_lengths) == {4}


@pytest.mark.parametrize("which", ["random_drafter", "trained_drafter"])
def test_larger_budget_never_lowers_tau_and_stays_lossless(target, prompts, which, request):
    drafter = request.getfixturevalue(which)
    eos = eos_token_ids(target)
    greedy = [greedy_generate(target, p, 24, eos) for p in prompts]
    taus = []
    for budget in (7, 16, 64):
        outs = [speculative_generate(target, p, drafter=drafter, max_new_tokens=24, eos_ids=eos, tree_budget=budget)
                for p in prompts]
        assert [o.tokens for o in outs] == greedy
        taus.append(summarize(outs, BS)["tau"])
    # Per step a bigger tree is a superset (nested), so it accepts at least as much from the same position.
    assert taus[0] <= taus[1] <= taus[2]
    if which == "trained_drafter":  # its second choices are often right: the wider tree accepts more (1.40 -> 1.62)
        assert taus[2] > taus[0]
