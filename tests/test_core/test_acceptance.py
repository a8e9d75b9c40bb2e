"""est_tau (components/acceptance.py): greedy decoding walked over the data.

A hand-built prediction table gives a known walk, est_tau and pooled value, where the uniform tau of
the same table differs; on greedy text of the tiny target a drafter fitted to it gives the same
per-step accepted lengths as a plain loop over single blocks (`forward_infer`, one block at a time)
and as real speculative decoding (eval/speculative.py) of the same prompts. The trainer's cadence: which
steps walk and which rows, and a record's figure pooled over the walks of its window, by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_ds.components.acceptance import decode_walk, walk_anchors, walk_metrics, walk_sums
from dflash_ds.components.loss import leading_run

BS = 4  # block size of the hand-built cases: 3 predicted positions


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def table_case():
    """One row of 16 tokens: prompt 0-1, response 2-13, then padding (length 14).

    `wrong[a]` lists the block positions k (1..3) the block anchored at a gets wrong. Only the blocks at 2
    and 12 are weak, and the walk lands on both; a uniform average weighs them 2 in 9 (12 has no whole
    block inside the row, so training never samples it).
    """
    mask = torch.zeros(1, 16, dtype=torch.long)
    mask[0, 2:14] = 1
    lengths = torch.tensor([14])
    wrong = {2: [2], 3: [], 4: [], 5: [], 6: [], 7: [], 8: [], 9: [], 10: [], 11: [3], 12: [2]}
    return mask, lengths, wrong


def test_walk_by_hand_and_uniform_tau_differs() -> None:
    mask, lengths, wrong = table_case()
    anchors, valid = walk_anchors(mask, lengths)
    assert anchors[valid].tolist() == list(range(2, 13))  # response positions with a response label after them
    correct = torch.ones(1, anchors.shape[1], BS - 1, dtype=torch.bool)
    for j, a in enumerate(anchors[0].tolist()):
        for k in wrong.get(a, []):
            correct[0, j, k - 1] = False
    label_valid = (anchors[:, :, None] + torch.arange(1, BS)) < 14  # labels inside the response (it ends at 13)
    runs = leading_run(correct, label_valid & valid[:, :, None])
    assert runs[0].tolist() == [1, 3, 3, 3, 3, 3, 3, 3, 3, 2, 1]
    # The walk: anchor 2 accepts 1 (+ bonus) -> 2 tokens, next anchor 4; 4 accepts 3 -> 4 tokens, anchor 8;
    # 8 accepts 3 -> 4 tokens, anchor 12; 12 accepts 1 (its label 14 is past the response) -> 2 tokens, done.
    dense = np.zeros(16, dtype=np.int64)
    dense[2:13] = runs[0].numpy()
    assert decode_walk(dense, mask[0].numpy(), 14) == [[2, 4, 4, 2]]
    sums = walk_sums(runs, anchors, valid, mask, lengths, BS)
    assert sums["tokens"] == 12 and sums["steps"] == 4 and sums["responses"] == 1
    # Uniform candidates, as training samples them: a >= 1 and a + 4 <= 14, i.e. anchors 2..10.
    assert sums["blocks"] == 9 and sums["streak"] == 1 + 3 * 8
    figures = walk_metrics(sums, "val_")
    assert figures["val_est_tau"] == pytest.approx(3.0) and figures["val_est_tau_pooled"] == pytest.approx(3.0)
    assert figures["val_tau"] == pytest.approx(1 + 25 / 9)  # 3.78: the uniform average overstates the walk


def test_responses_walk_apart_and_est_tau_is_a_mean_over_responses() -> None:
    """Two assistant turns of one row are two decodes (the user turn between is not decoded); a one-token
    response has no decode step. est_tau averages per-response means (eval's tau), pooled weighs steps."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 0]])
    runs_at = {1: 3, 5: 1}  # a good first turn; every block of the second one misses at once
    walks = decode_walk(np.array([runs_at.get(i, 0) for i in range(16)]), mask[0].numpy(), 16)
    assert walks == [[4, 2], [1, 1, 1]]
    anchors, valid = walk_anchors(mask, torch.tensor([16]))
    assert anchors[valid].tolist() == [1, 2, 3, 4, 5, 9, 10, 11]
    runs = torch.tensor([[runs_at.get(a, 0) for a in anchors[0].tolist()]])
    m = walk_metrics(walk_sums(runs, anchors, valid, mask, torch.tensor([16]), BS), "")
    assert m["est_tau"] == pytest.approx((6 / 2 + 3 / 3) / 2)  # 2.0: per-response means 3 and 1
    assert m["est_tau_pooled"] == pytest.approx(9 / 5)
    assert "tau" not in m  # the training tau of a record comes from the loss statistics, not from here


def test_walk_cadence_and_rows_by_hand() -> None:
    """Walks at the steps completing a multiple of est_tau_interval, none with est_tau_rows 0; rows from the middle
    of equal parts of the (length-sorted) batch, not its shortest first rows."""
    from dflash_ds.config import Config
    from dflash_ds.runtime.evaluate import walk_rows, walks_at

    cfg = Config()
    cfg.train.est_tau_rows, cfg.train.est_tau_interval = 4, 25
    assert [s for s in range(100) if walks_at(cfg, s)] == [24, 49, 74, 99]  # records call them 25, 50, ...
    cfg.train.est_tau_rows = 0
    assert not any(walks_at(cfg, s) for s in range(100))
    assert walk_rows(10, 2) == [2, 7] and walk_rows(9, 3) == [1, 4, 7] and walk_rows(3, 1) == [1]
    assert walk_rows(3, 5) == [0, 1, 2] and walk_rows(4, 0) == [0, 1, 2, 3]


def test_a_record_pools_the_walks_of_its_window_by_hand(tmp_path) -> None:
    """Fixed walk sums at steps 20, 40, 60, a window of 8 rows of 2 per drafter on 2 drafters: 2 walks, so the
    record at 60 pools 40 and 60 only; a run resumed at 40 reads its walks back (a later line for a step
    replaces an earlier one)."""
    from dflash_ds.config import Config
    from dflash_ds.runtime.evaluate import pooled_walks
    from dflash_ds.runtime.step_metrics import WalkHistory

    cfg = Config()
    cfg.train.est_tau_rows, cfg.train.est_tau_window = 2, 8
    keep = pooled_walks(cfg, 2)
    assert keep == 2 and pooled_walks(cfg, 3) == 2 and pooled_walks(cfg, 8) == 1  # ceil(8 / 6) = 2
    table = {"tokens": 12.0, "steps": 4.0, "tau_sum": 3.0, "responses": 1.0, "streak": 25.0, "blocks": 9.0}
    weak = {"tokens": 10.0, "steps": 10.0, "tau_sum": 2.0, "responses": 2.0, "streak": 0.0, "blocks": 5.0}
    strong = {"tokens": 30.0, "steps": 6.0, "tau_sum": 15.0, "responses": 3.0, "streak": 9.0, "blocks": 3.0}
    history = WalkHistory()
    assert history.pooled(10) is None  # before the first walk a record carries no est_tau
    for done, sums in ((20, weak), (40, table), (60, strong)):
        history.add(done - 1, None, keep)  # a step without a walk between
        history.add(done, sums, keep)
    figures = walk_metrics(history.pooled(60), "")
    assert figures["est_tau"] == pytest.approx((3.0 + 15.0) / (1 + 3))  # 4.5: per-response means, 40 and 60
    assert figures["est_tau_pooled"] == pytest.approx((12 + 30) / (4 + 6))  # 4.2
    assert walk_metrics(history.pooled(59), "")["est_tau"] == pytest.approx(3.0)  # up to 59: 40 only (20 dropped)
    path = tmp_path / "walks0.jsonl"
    lines = [{"step": 20, **weak}, {"step": 40, **weak}, {"step": 60, **table}, {"step": 40, **table}]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    resumed = WalkHistory.read(path, 40)  # 60 was walked after the checkpoint at 40: not read
    resumed.add(60, strong, keep)
    assert resumed.pooled(60) == history.pooled(60)


def test_est_tau_scales_the_walks_to_the_training_tau_by_hand(tmp_path) -> None:
    """A record's est_tau is 1 + (training tau - 1) x (walked acceptance - 1) / (uniform tau of the walked rows - 1),
    the training tau that of every block of the last est_tau_interval steps (UniformHistory, read back on a resume);
    the walks' own figure stays as est_tau_walked, the validation figures are not scaled, and the uniform runs that
    calibrate are the argmax's (`uniform_runs`), not the walk's."""
    from dflash_ds.components.acceptance import calibrated_walk
    from dflash_ds.runtime.step_metrics import UniformHistory, WindowTotals

    pooled = {"tokens": 42.0, "steps": 10.0, "tau_sum": 18.0, "responses": 4.0, "streak": 34.0, "blocks": 12.0}
    drafts = 34 / 12  # 2.83 accepted drafts (uniform) on the walked rows; the walks read 4.5 and 4.2 (pooled)
    got = calibrated_walk(pooled, 5.0)
    assert got["est_tau"] == pytest.approx(1 + 3.5 * 4.0 / drafts) and got["est_tau_walked"] == pytest.approx(4.5)
    assert got["est_tau_pooled"] == pytest.approx(1 + 3.2 * 4.0 / drafts)
    assert calibrated_walk({**pooled, "blocks": 0.0}, 5.0) == walk_metrics(pooled, "")  # nothing to scale by
    assert calibrated_walk({**pooled, "streak": 0.0}, 5.0)["est_tau"] == pytest.approx(4.5)  # walked rows at 1
    assert calibrated_walk(dict.fromkeys(pooled, 0.0), 5.0) == {}  # no walk yet: no est_tau

    # Windows closed at 5, 10, 15, 20 (streak, blocks over the drafters); interval 10: the record at 20 scales to
    # the windows at 15 and 20, (30 + 12) / (10 + 6) streak a block.
    history, taus = UniformHistory(), {}
    for done, streak, blocks in ((5, 2.0, 8.0), (10, 9.0, 6.0), (15, 30.0, 10.0), (20, 12.0, 6.0)):
        history.add(done, streak, blocks, 10)
        taus[done] = history.tau(done, 10)
    assert taus[20] == pytest.approx(1 + 42 / 16) and taus[15] == pytest.approx(1 + 39 / 16)
    assert sorted(history.windows) == [15, 20]  # older windows dropped
    path = tmp_path / "uniform0.jsonl"
    lines = [(5, 2.0, 8.0), (10, 1.0, 1.0), (15, 30.0, 10.0), (10, 9.0, 6.0), (20, 12.0, 6.0)]  # 10 redone
    path.write_text("".join(json.dumps({"step": d, "streak": st, "blocks": b}) + "\n" for d, st, b in lines))
    resumed = UniformHistory.read(path, 15)  # 20 closed after the checkpoint at 15: not read
    assert resumed.tau(15, 10) == taus[15]
    resumed.add(20, 12.0, 6.0, 10)
    assert resumed.tau(20, 10) == taus[20] and UniformHistory().tau(20, 10) is None

    window = WindowTotals({f"{kind}_{k}": v for kind in ("est", "val") for k, v in pooled.items()}, 0.0, [], [], [], [],
                          est_base_tau=5.0)
    figures = window.walks()
    assert figures["est_tau"] == pytest.approx(got["est_tau"]) and figures["val_est_tau"] == pytest.approx(4.5)
    assert figures["val_tau"] == pytest.approx(1 + drafts)

    # The runs of the by-hand walk above, with an argmax that does worse than the walk at anchor 4.
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    anchors, valid = walk_anchors(mask, torch.tensor([14]))
    runs = torch.tensor([[1, 3, 3, 3, 3, 3, 3, 3, 3, 2, 1]])
    argmax = runs.clone()
    argmax[0, 2] = 0  # anchor 4
    sums = walk_sums(runs, anchors, valid, mask, torch.tensor([14]), BS, uniform_runs=argmax)
    assert sums["tokens"] == 12 and sums["steps"] == 4 and sums["streak"] == 1 + 3 * 8 - 3


def greedy_rows(target, prompts, new_tokens):
    """Each prompt plus the target's greedy answer; the answer is the response (loss mask on)."""
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate

    rows = []
    for prompt in prompts:
        out = greedy_generate(target, prompt, new_tokens, eos_token_ids(target))
        rows.append((prompt + out, len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (seq, start) in enumerate(rows):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, start:len(seq)] = 1
    return ids, mask, torch.tensor([len(seq) for seq, _ in rows])


@pytest.fixture(scope="module")
def fitted(tiny_target):
    """A 1-layer drafter fitted for a few dozen steps to the tiny target's greedy answers to 3 prompts."""
    from transformers import AutoTokenizer

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.config import LossConfig
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
    ids, mask, lengths = greedy_rows(target, prompts, 40)
    arch = drafter_arch_from_target(tiny_target, num_layers=1, block_size=8)
    drafter = DFlashDrafter(arch)
    drafter.init_weights(0)
    parts = target_parts(target)
    module = DrafterTrainModule(drafter, parts.embed, parts.head)
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    context, last = capture_hidden(target, ids, attn, arch.target_layer_ids)
    states = TargetStates(ids, mask, lengths, context, last)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(60):
        terms, _ = module(states, LossConfig(num_anchors=64, gamma=4.0), step, 0.0, 0)
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
    return target, module.eval(), prompts, states


def single_block_walks(module, states):
    """The reference: each response decoded by a plain loop, one block through `forward_infer` at a time."""
    drafter, bs = module.drafter, module.drafter.arch.block_size
    walks = []
    with torch.no_grad():
        for row in range(states.input_ids.shape[0]):
            ids = states.input_ids[row]
            on = states.loss_mask[row].nonzero().view(-1).tolist()
            p, e = on[0], on[-1]
            steps, a = [], p
            while a < e:
                block = torch.full((1, bs), drafter.arch.mask_token_id)
                block[0, 0] = ids[a]
                hidden = drafter.forward_infer(states.context[row:row + 1, :a], module.embed(block), a)
                guess = module.lm_head(hidden[0, 1:]).argmax(-1).tolist()
                accepted = 0
                while accepted < bs - 1 and a + accepted + 1 <= e and guess[accepted] == int(ids[a + accepted + 1]):
                    accepted += 1
                steps.append(accepted + 1)
                a += accepted + 1
            walks.append(steps)
    return walks


def test_est_tau_of_a_real_drafter_equals_single_blocks_and_speculative_decoding(fitted) -> None:
    from dflash_ds.config import Config
    from dflash_ds.eval.speculative import eos_token_ids, speculative_generate, summarize
    from dflash_ds.runtime.evaluate import estimate

    target, module, prompts, states = fitted
    reference = single_block_walks(module, states)
    assert max(max(w) for w in reference) >= 3  # the fitted drafter gets whole runs right: a real test
    cfg = Config()
    cfg.loss.max_anchors_per_batch = 16  # 3 rows x 5 anchors per forward: several forwards per batch
    tensors = {"input_ids": states.input_ids, "loss_mask": states.loss_mask, "lengths": states.lengths,
               "context": states.context, "last_hidden": states.last_hidden}
    sums = estimate(module, tensors, cfg, torch.float32)
    per_row = [sum(w) / len(w) for w in reference]
    assert sums["responses"] == 3 and sums["steps"] == sum(len(w) for w in reference)
    assert sums["tokens"] == sum(sum(w) for w in reference)
    assert sums["tau_sum"] == pytest.approx(sum(per_row))
    # one row of three: the middle one (walk_rows)
    assert estimate(module, tensors, cfg, torch.float32, rows=1)["tau_sum"] == pytest.approx(per_row[1])
    # Served: the same drafter decoding the same prompts against the target. Every step but the last matches
    # (the walk stops at the response's end; decoding counts the last step's acceptance in full).
    served = [speculative_generate(target, p, drafter=module.drafter, max_new_tokens=40,
                                   eos_ids=eos_token_ids(target)) for p in prompts]
    for out, walk in zip(served, reference):
        assert out.accept_lengths[:-1] == walk[:-1] and out.accept_lengths[-1] >= walk[-1]
    served_tau = summarize(served, 8)["tau"]
    print(f"est_tau {sum(per_row) / 3:.3f}, served tau {served_tau:.3f}")
    assert abs(sum(per_row) / 3 - served_tau) < 0.5


def test_est_tau_with_target_labels_reads_the_targets_choices(fitted) -> None:
    """loss.labels = target: the labels are argmax lm_head(final hidden) one position back; on the target's own
    greedy text they are the data, so est_tau is the same."""
    from dflash_ds.config import Config
    from dflash_ds.runtime.evaluate import estimate

    _, module, _, states = fitted
    tensors = {"input_ids": states.input_ids, "loss_mask": states.loss_mask, "lengths": states.lengths,
               "context": states.context, "last_hidden": states.last_hidden}
    data_cfg, target_cfg = Config(), Config()
    target_cfg.loss.labels = "target"
    assert estimate(module, tensors, target_cfg, torch.float32) == estimate(module, tensors, data_cfg, torch.float32)


def test_leading_argmax_gives_the_runs_of_the_full_argmax() -> None:
    """The walk's head runs position by position on the blocks still alive: the leading runs are the full
    argmax's, and a dead block's later positions are never computed (-1)."""
    from dflash_ds.components.acceptance import leading_argmax
    from dflash_ds.components.loss import leading_run

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(40, 5, 8, generator=g)
    full = head(hidden).argmax(-1)
    keep = torch.rand(40, 5, generator=g) < 0.8  # labels: the argmax where kept, another token elsewhere
    labels = torch.where(keep, full, (full + 1) % 11)
    valid = torch.rand(40, 5, generator=g) < 0.9
    picks = leading_argmax(hidden, head, labels, valid)
    runs = leading_run(picks == labels, valid)
    assert torch.equal(runs, leading_run(full == labels, valid)) and runs.max() >= 3
    for n, run in enumerate(runs.tolist()):
        assert torch.equal(picks[n, :run + 1], full[n, :run + 1]) and (picks[n, run + 1:] == -1).all()
