"""A fitted DFlash2 drafter drafts by its selector's walk everywhere, a fitted DSpark drafter by its Markov chain
(both sequential: `draft_tokens`): speculative decoding is lossless at T = 0, and, as a law, at T > 0 (the sampled
walk / chain); the train-time est_tau (components/acceptance.py, through the walk) equals a plain
one-block-at-a-time loop of the walk and the served decode steps on the same rows."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_ds.errors import DFlashError
from proc_utils import forked_map

BS = 8


@pytest.fixture(scope="module", params=["dflash2", "dspark"])
def fitted2(request, tiny_target: Path):
    """A 1-layer DFlash2 drafter fitted 40 steps (DFlash + selector loss) to the target's greedy answers; or a DSpark
    one (DeepSpec's objective: 0.1 CE + 0.9 L1 to the target's distribution + the confidence BCE, gamma 4)."""
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
    from dflash_ds.models.dspark_arch import DSparkOptions

    dspark = request.param == "dspark"
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=BS,
                                    options=DSparkOptions(markov_rank=16) if dspark else
                                    DFlash2Options(conv_group_size=32, selector_rank=16, selector_top_k=4))
    loss_cfg = LossConfig(num_anchors=32, gamma=4.0, **({"lk": "l1", "lk_weight": 0.9} if dspark else {}))
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    if dspark:  # a Markov head that starts large: 40 steps on 3 answers leave a small one without effect on drafts
        with torch.no_grad():
            for p in drafter.markov_head.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    parts = target_parts(target)
    module = DrafterTrainModule(drafter, parts.embed, parts.head)
    context, last = capture_hidden(target, ids, (torch.arange(width)[None] < lengths[:, None]).long(),
                                   arch.target_layer_ids)
    states = TargetStates(ids, mask, lengths, context, last)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(40):
        terms, _ = module(states, loss_cfg, step, 0.0, 0)
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


def argmax_loop(module, states, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, A] leading runs of the backbone's argmax, each block on its own through forward_infer (eval's path): the
    count of leading drafts equal to the next response tokens of the row."""
    drafter, out = module.drafter, torch.zeros(anchors.shape, dtype=torch.long)
    with torch.no_grad():
        for r, i in valid.nonzero().tolist():
            a, ids, length = int(anchors[r, i]), states.input_ids[r], int(states.lengths[r])
            block = torch.full((1, BS), drafter.arch.mask_token_id)
            block[0, 0] = ids[a]
            hidden = drafter.forward_infer(states.context[r:r + 1, :a], module.embed(block), a)
            guess = module.lm_head(hidden[0, 1:]).argmax(-1).tolist()
            n = 0
            while (n < BS - 1 and a + n + 1 < length and states.loss_mask[r, a + n + 1]
                   and guess[n] == int(ids[a + n + 1])):
                n += 1
            out[r, i] = n
    return out


def teacher_forced_runs_are_the_chains(module, states) -> None:
    """DSpark: the training objective's own hits (`correct`: teacher-forced, position k's Markov bias read from the
    gold token before it) on every block with a whole block after it have the chain's leading runs, since the chain
    reads the gold previous token for as long as it is right. (accepted_runs' [..., 1] is its [..., 0] for DSpark.)
    Past a block's first miss the two part: there every hit is the teacher-forced one, by hand, and neither the
    chain's own previous token nor the anchor in its place gives the same hits (so a loss that dropped teacher
    forcing fails here, which the leading runs alone cannot see)."""
    from dflash_ds.components.acceptance import accepted_runs
    from dflash_ds.components.anchors import block_inputs_and_labels, sample_anchors
    from dflash_ds.components.loss_metrics import leading_run
    from dflash_ds.components.objective import drafter_objective
    from dflash_ds.config import LossConfig

    drafter, every = module.drafter, 10 ** 6  # more than the rows hold: every candidate anchor, whatever is drawn
    cfg = LossConfig(num_anchors=every, max_anchors_per_batch=0, gamma=4.0, lk="l1", lk_weight=0.9)
    anchors, valid = sample_anchors(states.loss_mask, states.lengths, BS, every, torch.Generator().manual_seed(0))
    with torch.no_grad():
        terms, _ = drafter_objective(drafter, module.embed, module.lm_head, states, cfg,
                                     anchor_gen=torch.Generator().manual_seed(0))
        chain = accepted_runs(drafter, module.embed, module.lm_head, states.context, states.input_ids,
                              states.input_ids, states.loss_mask, states.lengths, anchors, valid, 64)[..., 0]
        blocks, labels, label_valid = block_inputs_and_labels(states.input_ids, states.loss_mask, states.lengths,
                                                              anchors, valid, BS, drafter.arch.mask_token_id)
        hidden = drafter.forward_train(states.context, module.embed(blocks), anchors)[:, :, 1:].flatten(0, 1)
        labels, label_valid, anchor_ids = labels.flatten(0, 1), label_valid.flatten(0, 1), blocks[:, :, 0].flatten()
        base = module.lm_head(hidden).float()

        def hits(prev: torch.Tensor) -> torch.Tensor:  # position k's argmax with the Markov bias of prev[:, k]
            bias = drafter.markov_head.bias(drafter.markov_head.embed(prev)).float()
            return ((base + bias).argmax(-1) == labels) & label_valid

        gold = torch.cat([anchor_ids[:, None], labels[:, :-1].clamp(min=0)], dim=1)
        own = torch.cat([anchor_ids[:, None], drafter.draft_tokens(hidden, module.lm_head, anchor_ids).tokens[:, :-1]],
                        dim=1)
        forced, free, anchored = hits(gold), hits(own), hits(anchor_ids[:, None].expand_as(gold))
    taught = leading_run(terms.correct, terms.valid).view(chain.shape)
    assert int(valid.sum()) >= 60 and int(chain.sum()) > 0
    assert torch.equal(taught * valid, chain * valid), (taught, chain)
    assert torch.equal(terms.correct & terms.valid, forced)
    print(f"teacher forcing: {int((forced != free).sum())} hits differ from the free chain's, "
          f"{int((forced != anchored).sum())} from the anchor's, over {int(label_valid.sum())} positions")
    assert not torch.equal(forced, free) and not torch.equal(forced, anchored)


def test_walk_drafts_lossless_and_est_tau_through_the_walk(fitted2, tiny_target, tmp_path) -> None:
    from dflash_ds.cli import main
    from dflash_ds.components.acceptance import accepted_runs, walk_anchors
    from dflash_ds.config import Config
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate, speculative_generate, summarize
    from dflash_ds.runtime.evaluate import estimate
    from dflash_ds.tiny.corpus import tiny_prompts

    target, module, prompts, states = fitted2
    reference, differ = walk_loop(module, states)
    print(f"{module.drafter.kind}: {differ} drafted tokens differ from the argmax")
    assert differ > 0  # measured 77: the walk is not the argmax here, so the equalities below are the walk's
    assert max(max(w) for w in reference) >= 3  # the fitted walk gets whole runs right: a real test
    tensors = {"input_ids": states.input_ids, "loss_mask": states.loss_mask, "lengths": states.lengths,
               "context": states.context, "last_hidden": states.last_hidden}
    sums = estimate(module, tensors, Config(), torch.float32)
    per_row = [sum(w) / len(w) for w in reference]
    # The walk's runs, and beside them the argmax's (what the training `tau` counts, which a record's est_tau is
    # scaled by): those equal a DFlash drafter's of the same backbone (one without the selector's walk).
    anchors, valid = walk_anchors(states.loss_mask, states.lengths)
    args = (module.embed, module.lm_head, states.context, states.input_ids, states.input_ids, states.loss_mask,
            states.lengths, anchors, valid, 64)
    with torch.no_grad():
        runs = accepted_runs(module.drafter, *args)
        plain = accepted_runs(SimpleNamespace(arch=module.drafter.arch, forward_train=module.drafter.forward_train,
                                              sequential=False, draft_tables=lambda: None), *args)
    assert torch.equal(plain[..., 0], argmax_loop(module, states, anchors, valid))  # the argmax's, on the decode path
    if module.drafter.kind == "dflash2":
        assert torch.equal(runs[..., 1], plain[..., 0])
        assert not torch.equal(runs[..., 0], runs[..., 1])  # the walk accepts other lengths than the argmax
    else:
        assert not torch.equal(runs[..., 0], plain[..., 0])  # the chain is not the backbone's argmax
        teacher_forced_runs_are_the_chains(module, states)
    assert sums["steps"] == sum(len(w) for w in reference) and sums["tau_sum"] == pytest.approx(sum(per_row))
    eos = eos_token_ids(target)
    served = [speculative_generate(target, p, drafter=module.drafter, max_new_tokens=32, eos_ids=eos) for p in prompts]
    for prompt, out, walk in zip(prompts, served, reference):
        assert out.tokens == greedy_generate(target, prompt, 32, eos)  # lossless at T = 0
        assert out.accept_lengths[:-1] == walk[:-1] and out.accept_lengths[-1] >= walk[-1]
    print(f"{module.drafter.kind} est_tau {sum(per_row) / 3:.3f}, served tau {summarize(served, BS)['tau']:.3f}")
    # The same through an export and `dflash-ds eval`, greedy (checked lossless against plain greedy decoding) and
    # sampled with the walk at T > 0 (its law: test_sampled_walk_decodes_with_the_targets_law).
    export = module.drafter.save_pretrained(tmp_path / "export")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_prompts(3)))
    stop = ["--confidence-stop", "0.5"] if module.drafter.kind == "dspark" else []
    for extra in (stop, ["--temperature", "0.03", "--draft-sample", "probabilistic"]):
        assert main(["eval", "--target", str(tiny_target), "--drafter", str(export), "--data", str(data),
                     "--num-prompts", "3", "--max-new-tokens", "32", "--json", str(tmp_path / "r.json"),
                     "--device", "cpu", *extra]) == 0
        r = json.loads((tmp_path / "r.json").read_text())
        greedy = "--temperature" not in extra
        assert r["mismatches"] == [] and r["lossless_checked"] == greedy, r
        if greedy:  # tau of the export = the in-memory drafter's = the walk's but each response's last step
            assert r["tau"] == pytest.approx(summarize(served, BS)["tau"]), r
        if greedy and stop:  # the confidence head against real acceptance, with and without cutting the drafts
            c, cut = r["confidence_calibration"], r["confidence_stop"]
            assert 0 <= c["ece"] <= 1 and 0 <= c["brier"] <= 1 and c["judged_tokens"] >= r["decode_steps"], c
            assert cut["drafted_per_accepted"] < r["drafted_per_accepted"], (cut, r)
            print(f"dspark confidence: ECE {c['ece']:.3f} Brier {c['brier']:.3f}; stop 0.5: tau {cut['tau']:.3f} vs "
                  f"{r['tau']:.3f}, drafted/accepted {cut['drafted_per_accepted']:.2f} vs {r['drafted_per_accepted']:.2f}")
    with pytest.raises(DFlashError, match=f"tree drafting is not implemented for a {module.drafter.kind} drafter"):
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


def _target_law(target, prompt: list[int], temperature: float, depth: int, floor: float) -> dict[tuple, float]:
    """The target's own law of its next `depth` sampled tokens at `temperature`: every sequence whose probability is
    at least `floor`, found by expanding the prefixes that can still reach it."""
    law = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for seq, mass in law.items():
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1].float()
            probs = torch.softmax(logits.double() / temperature, -1)
            for tok in (probs * mass >= floor).nonzero().view(-1).tolist():
                grown[seq + (tok,)] = mass * float(probs[tok])
        law = grown
    return law


def _chi_square(counts: Counter, law: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `law` (every sequence of it a bin, the rest one bin) and its dof."""
    stat, rest = 0.0, n - sum(counts[s] for s in law)
    for seq, p in law.items():
        stat += (counts[seq] - n * p) ** 2 / (n * p)
    other = n * (1.0 - sum(law.values()))
    stat += (rest - other) ** 2 / max(other, 1e-9)
    return stat, len(law)


def test_sampled_walk_decodes_with_the_targets_law(fitted2, monkeypatch) -> None:
    """Lossless at T > 0, as a law: the first three tokens speculative decoding emits with the probabilistic walk
    (each draft position's q conditioned on the token drawn before it) follow the target's own law, and so they
    would not if the verification accepted the walk's draws as they are (the control, same test).

    T = 0.03: the random tiny target's logits are ~0.2 apart, so at T = 1 its law is nearly uniform over 512 tokens
    (entropy 6.22 nats of ln 512 = 6.24) and no 3-token sequence could be binned; at 0.03 it is spread over tens of
    sequences. Measured with 3,000 runs: 44 bins of >= 5 expected draws hold 0.944 of the law, chi2 39.3 against
    the 0.999 quantile 78.8; the first draft step accepts 0, 1 and 2 walked tokens in 1,759 / 764 / 477 runs. Power:
    a q misreported as the walk's distribution at 2T (the draws unchanged) gives chi2 127.5 and fails; accepting
    every draw gives ~2e4 on 300 runs."""
    from dflash_ds.eval import speculative as spec

    target, module, prompts, _ = fitted2
    # DSpark: the prompt its chain drafts best (greedy tau 5.2 there, 2.2 on the first), so that the first step's
    # second position is verified in hundreds of runs
    prompt = prompts[2 if module.drafter.kind == "dspark" else 0]
    temperature, n = 0.03, 3000

    def decode_seeds(seeds: range) -> tuple[Counter, Counter]:
        seqs, first_steps = Counter(), Counter()
        for i in seeds:
            out = spec.speculative_generate(target, prompt, drafter=module.drafter, max_new_tokens=3, eos_ids=[],
                                            temperature=temperature, draft_sample="probabilistic",
                                            generator=torch.Generator().manual_seed(i))
            seqs[tuple(out.tokens[:3])] += 1
            first_steps[min(out.accept_lengths[0], 3)] += 1  # the first draft step: accepted + 1, capped at 3
        return seqs, first_steps

    def decode(runs: int) -> tuple[Counter, Counter]:
        """Runs 0 .. runs - 1 (each seeded by its index: the same counts however they are split)."""
        parts = forked_map(decode_seeds, [range(runs)[k::2] for k in range(2)])
        return sum((p[0] for p in parts), Counter()), sum((p[1] for p in parts), Counter())

    law = _target_law(target, prompt, temperature, 3, floor=5.0 / n)  # bins of >= 5 expected draws
    seqs, first_steps = decode(n)
    stat, dof = _chi_square(seqs, law, n)
    # Wilson-Hilferty: the chi-square 0.999 quantile of `dof` degrees of freedom.
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    print(f"T={temperature}: {len(law)} bins hold {sum(law.values()):.3f} of the law; chi2 {stat:.1f} (dof {dof}, "
          f"0.999 quantile {bound:.1f}); first step accepted+1: {dict(sorted(first_steps.items()))}")
    assert 0.5 < sum(law.values()) and len(law) >= 4, law  # a spread law, mostly in bins: a real comparison
    assert stat < bound, (stat, bound)
    # Both walked positions are verified in some runs and rejected in others: q_2 given x_1 is exercised.
    assert first_steps[1] > n // 20 and first_steps[3] > n // 20, first_steps

    # Control: accept every draft token (the bonus then drawn from p) and the law is the walk's, far from it.
    def accept_all(draft, q, p, gen):
        return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=gen))

    monkeypatch.setattr(spec, "_accept_sampled", accept_all)
    wrong, _ = decode(n // 10)
    wrong_stat = _chi_square(wrong, law, n // 10)[0]
    print(f"control (every draft accepted): chi2 {wrong_stat:.1f}")
    assert wrong_stat > 3 * bound
