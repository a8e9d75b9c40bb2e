"""A fitted DFlash2 drafter drafts by its selector's walk everywhere: speculative decoding is lossless at T = 0,
and the train-time est_tau (components/acceptance.py, through the walk) equals a plain one-block-at-a-time loop
of the walk and the served decode steps on the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_ds.errors import DFlashError

BS = 8


@pytest.fixture(scope="module")
def fitted2(tiny_target: Path):
    """A 1-layer DFlash2 drafter fitted 40 steps (DFlash + selector loss) to the target's greedy answers."""
    from transformers import AutoTokenizer

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.config import LossConfig
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate
    from dflash_ds.models.dflash2_arch import DFlash2Options
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.from_target import drafter_arch_from_target
    from dflash_ds.models.target import capture_hidden, load_target, target_parts
    from dflash_ds.runtime.engine import DrafterTrainModule
    from dflash_ds.tiny.corpus import tiny_prompts

    torch.set_num_threads(1)
    target = load_target(tiny_target)
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    prompts = [tok(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in tiny_prompts(3)]
    seqs = [(p, greedy_generate(target, p, 32, eos_token_ids(target))) for p in prompts]
    width = max(len(p) + len(a) for p, a in seqs)
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p):len(p) + len(a)] = 1
    lengths = torch.tensor([len(p) + len(a) for p, a in seqs])
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=BS,
                                    dflash2=DFlash2Options(conv_group_size=32, selector_rank=16, selector_top_k=4))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    parts = target_parts(target)
    module = DrafterTrainModule(drafter, parts.embed, parts.head)
    context, last = capture_hidden(target, ids, (torch.arange(width)[None] < lengths[:, None]).long(),
                                   arch.target_layer_ids)
    states = TargetStates(ids, mask, lengths, context, last)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(40):
        terms, _ = module(states, LossConfig(num_anchors=32, gamma=4.0), step, 0.0, 0)
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
    return target, module.eval(), prompts, states


def walk_loop(module, states) -> tuple[list[list[int]], int]:
    """Each response decoded by a plain loop: one block through forward_infer, drafted by the selector's walk;
    and how many drafted tokens differ from the per-position argmax."""
    drafter, walks, differ = module.drafter, [], 0
    with torch.no_grad():
        for row in range(states.input_ids.shape[0]):
            ids = states.input_ids[row]
            on = states.loss_mask[row].nonzero().view(-1).tolist()
            a, e, steps = on[0], on[-1], []
            while a < e:
                block = torch.full((1, BS), drafter.arch.mask_token_id)
                block[0, 0] = ids[a]
                hidden = drafter.forward_infer(states.context[row:row + 1, :a], module.embed(block), a)
                guess = drafter.draft_tokens(hidden[:, 1:], module.lm_head, block[:, 0])[0][0].tolist()
                differ += sum(g != u for g, u in zip(guess, module.lm_head(hidden[0, 1:]).argmax(-1).tolist()))
                n = 0
                while n < BS - 1 and a + n + 1 <= e and guess[n] == int(ids[a + n + 1]):
                    n += 1
                steps.append(n + 1)
                a += n + 1
            walks.append(steps)
    return walks, differ


def test_walk_drafts_lossless_and_est_tau_through_the_walk(fitted2) -> None:
    from dflash_ds.config import Config
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate, speculative_generate, summarize
    from dflash_ds.runtime.evaluate import estimate

    target, module, prompts, states = fitted2
    reference, differ = walk_loop(module, states)
    assert differ > 0  # measured 77: the walk is not the argmax here, so the equalities below are the walk's
    assert max(max(w) for w in reference) >= 3  # the fitted walk gets whole runs right: a real test
    tensors = {"input_ids": states.input_ids, "loss_mask": states.loss_mask, "lengths": states.lengths,
               "context": states.context, "last_hidden": states.last_hidden}
    sums = estimate(module, tensors, Config(), torch.float32)
    per_row = [sum(w) / len(w) for w in reference]
    assert sums["steps"] == sum(len(w) for w in reference) and sums["tau_sum"] == pytest.approx(sum(per_row))
    eos = eos_token_ids(target)
    served = [speculative_generate(target, p, drafter=module.drafter, max_new_tokens=32, eos_ids=eos) for p in prompts]
    for prompt, out, walk in zip(prompts, served, reference):
        assert out.tokens == greedy_generate(target, prompt, 32, eos)  # lossless at T = 0
        assert out.accept_lengths[:-1] == walk[:-1] and out.accept_lengths[-1] >= walk[-1]
    print(f"DFlash2 est_tau {sum(per_row) / 3:.3f}, served tau {summarize(served, BS)['tau']:.3f}")
    with pytest.raises(DFlashError, match="tree drafting is not implemented for a DFlash2 drafter"):
        speculative_generate(target, prompts[0], drafter=module.drafter, tree_budget=8)


def test_sampled_walk_draws_the_engines_rule_and_decodes(fitted2) -> None:
    """T > 0, draft sampling probabilistic: position k draws from softmax(row / T) of the row after the token drawn
    at k - 1 (vLLM's Gumbel-max walk), q_k is that K-way distribution; speculative decoding runs on it."""
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate, speculative_generate
    from dflash_ds.eval.walk_draft import walk_q
    from dflash_ds.models.dflash2_selector import walk

    scores = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 0.5]]]])  # [1, 2 positions, K, K]
    cand = torch.tensor([[[5, 6], [7, 8]]])
    gen, n = torch.Generator().manual_seed(0), 4000
    counts = {}
    for _ in range(n):
        tokens, _ = walk(scores, cand, temperature=2.0, generator=gen)
        counts[tuple(tokens[0].tolist())] = counts.get(tuple(tokens[0].tolist()), 0) + 1
    first = torch.softmax(scores[0, 0, 0] / 2, -1)
    for i, a in enumerate((5, 6)):
        second = torch.softmax(scores[0, 1, i] / 2, -1)  # the row of the token drawn first
        for j, b in enumerate((7, 8)):
            assert abs(counts.get((a, b), 0) / n - float(first[i] * second[j])) < 0.025
    q = walk_q(cand[0], scores[0, :, 0], 10, 2.0)
    assert q[0, 5] == pytest.approx(float(first[0])) and q[1, 7] + q[1, 8] == pytest.approx(1.0)
    assert q.sum().item() == pytest.approx(2.0)
    target, module, prompts, _ = fitted2
    eos = eos_token_ids(target)
    runs = [speculative_generate(target, prompts[0], drafter=module.drafter, max_new_tokens=16, eos_ids=eos,
                                 temperature=1.0, draft_sample="probabilistic",
                                 generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and sum(runs[0].accept_lengths) >= len(runs[0].tokens) - 1
    # Near T = 0 the target samples its argmax: the sampled walk's output is the greedy text (lossless).
    cold = speculative_generate(target, prompts[1], drafter=module.drafter, max_new_tokens=16, eos_ids=eos,
                                temperature=1e-4, draft_sample="probabilistic", generator=torch.Generator())
    assert cold.tokens == greedy_generate(target, prompts[1], 16, eos)
