"""The DFlash loss and metrics against hand computations on tiny tensors."""

import math

import torch

from dflash_ds.components.loss import (block_inputs_and_labels, decay_weights, dflash_loss, leading_run,
                                       metric_sums, metrics_from_sums, sample_anchors, streak_weights)


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


LOGITS = [[[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.0, 3.0]]]
LABELS = [[0, 1, 0]]


def test_decay_weights_values():
    w = decay_weights(3, gamma=2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_ce_with_decay_and_masking_by_hand():
    logits = torch.tensor(LOGITS)
    labels = torch.tensor(LABELS)
    valid = torch.tensor([[True, True, False]])  # third position masked out
    out = dflash_loss(logits, labels, valid, gamma=2.0)
    ce = [-math.log(softmax(LOGITS[0][k])[LABELS[0][k]]) for k in range(3)]
    w = [1.0, math.exp(-0.5)]
    expected = (w[0] * ce[0] + w[1] * ce[1]) / (w[0] + w[1])
    assert abs(out.loss.item() - expected) < 1e-6
    # masking: changing the masked position's logits or label does not move the loss
    logits2 = logits.clone()
    logits2[0, 2] = torch.tensor([9.0, -9.0, 0.0])
    out2 = dflash_loss(logits2, torch.tensor([[0, 1, 2]]), valid, gamma=2.0)
    assert abs(out2.loss.item() - expected) < 1e-6


def test_kl_term_by_hand():
    logits = torch.tensor(LOGITS)
    target = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    alpha, temp, gamma = 0.25, 2.0, 3.0
    out = dflash_loss(logits, torch.tensor(LABELS), valid, gamma=gamma, target_logits=target,
                      kl_weight=alpha, kl_temperature=temp)
    num = den = 0.0
    for k in range(3):
        ce = -math.log(softmax(LOGITS[0][k])[LABELS[0][k]])
        pd = softmax([x / temp for x in LOGITS[0][k]])
        pt = softmax([x / temp for x in target[0, k].tolist()])
        kl = sum(t * (math.log(t) - math.log(d)) for t, d in zip(pt, pd)) * temp * temp
        w = math.exp(-k / gamma)
        num += w * ((1 - alpha) * ce + alpha * kl)
        den += w
    assert abs(out.loss.item() - num / den) < 1e-6


def test_streak_weights_by_hand():
    logits = torch.tensor(LOGITS)
    labels = torch.tensor(LABELS)
    valid = torch.ones(1, 3, dtype=torch.bool)
    p = [softmax(LOGITS[0][k])[LABELS[0][k]] for k in range(3)]
    s = streak_weights(torch.tensor([p]), valid)
    assert torch.allclose(s, torch.tensor([[1.0, p[0], p[0] * p[1]]]), atol=1e-7)
    # invalid positions do not break the product
    s2 = streak_weights(torch.tensor([p]), torch.tensor([[True, False, True]]))
    assert torch.allclose(s2, torch.tensor([[1.0, p[0], p[0]]]), atol=1e-7)
    lam, gamma = 0.5, 7.0
    out = dflash_loss(logits, labels, valid, gamma=gamma, streak_weight=lam)
    num = den = 0.0
    for k in range(3):
        w = (1 - lam) * math.exp(-k / gamma) + lam * [1.0, p[0], p[0] * p[1]][k]
        num += w * -math.log(p[k])
        den += w
    assert abs(out.loss.item() - num / den) < 1e-6


def test_no_valid_positions_gives_zero_loss_with_graph():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    out = dflash_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool), gamma=7.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert logits.grad is not None and torch.all(logits.grad == 0)


def test_metrics_on_hand_made_logits():
    # 10-way vocab; block A: correct, correct, wrong (label rank 3), correct; block B: wrong (rank 6) then correct.
    v = 10

    def row(order):  # logits whose descending order is `order`
        x = torch.zeros(v)
        for rank, tok in enumerate(order):
            x[tok] = float(v - rank)
        return x

    base = list(range(v))
    rank_of = lambda lab, r: [lab] + [t for t in base if t != lab] if r == 0 else \
        [t for t in base if t != lab][:r] + [lab] + [t for t in base if t != lab][r:]
    labels = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    ranks = [[0, 0, 3, 0], [6, 0, 0, 9]]
    logits = torch.stack([torch.stack([row(rank_of(int(labels[n, k]), ranks[n][k])) for k in range(4)])
                          for n in range(2)])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    terms = dflash_loss(logits, labels, valid, gamma=7.0)
    m = metrics_from_sums(metric_sums(terms))
    # correct: A has 3 of 4, B has 2 of 3 valid -> 5/7
    assert abs(m["accuracy"] - 5 / 7) < 1e-9
    # top4: A 4/4 (rank 3 is in top 4), B: rank 6 miss, 2 hits -> 6/7; top8: B rank 6 in top8 -> 7/7
    assert abs(m["top4_accuracy"] - 6 / 7) < 1e-9
    assert abs(m["top8_accuracy"] - 1.0) < 1e-9
    # streaks: A 2 (breaks at pos 3), B 0 -> mean 1, tau 2
    assert m["avg_streak"] == 1.0 and m["tau"] == 2.0
    # tree streak 4: A 4, B 0 -> 2; tree streak 8: A 4, B 3 (4th invalid) -> 3.5
    assert m["tree_streak4"] == 2.0 and m["tree_streak8"] == 3.5
    assert m["accuracy_per_position"] == [0.5, 1.0, 0.5, 1.0]


def test_leading_run():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    assert leading_run(hits, valid).tolist() == [2, 0, 2]


def test_anchor_sampling_rules_and_seed():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    lengths = torch.tensor([8, 10])
    bs = 3
    anchors, valid = sample_anchors(loss_mask, lengths, bs, num_anchors=100, generator=torch.Generator().manual_seed(0))
    # row 0: a in {2..5} (a + 3 <= 8); row 1: a in {1..7}
    assert anchors[0][valid[0]].tolist() == [2, 3, 4, 5]
    assert anchors[1][valid[1]].tolist() == [1, 2, 3, 4, 5, 6, 7]
    a1, _ = sample_anchors(loss_mask, lengths, bs, 3, torch.Generator().manual_seed(5))
    a2, _ = sample_anchors(loss_mask, lengths, bs, 3, torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2) and a1.shape == (2, 3)
    assert all(int(x) in range(1, 8) for x in a1[1])


def test_block_inputs_and_labels():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    lm = torch.tensor([[0, 0, 1, 1, 0, 1]])
    anchors = torch.tensor([[1, 3]])
    valid = torch.tensor([[True, True]])
    blocks, labels, lv = block_inputs_and_labels(ids, lm, torch.tensor([6]), anchors, valid, 3, mask_token_id=99)
    assert blocks.tolist() == [[[11, 99, 99], [13, 99, 99]]]
    assert labels.tolist() == [[[12, 13], [14, 15]]]
    assert lv.tolist() == [[[True, True], [False, True]]]
