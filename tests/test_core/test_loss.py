"""The DFlash loss and metrics against hand computations on tiny tensors."""

import math

import torch

from dflash_ds.components.loss import (block_inputs_and_labels, decay_weights, dflash_loss, leading_run,
                                       metric_sums, metrics_from_sums, sample_anchors, streak_weights, water_fill)


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


def quotas_by_search(counts: list[int], cap: int) -> list[int]:
    """Water-filling the slow way: binary search for the level, then one more each in row order."""
    if sum(counts) <= cap:
        return list(counts)
    lo, hi = 0, max(counts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(min(c, mid) for c in counts) <= cap else (lo, mid - 1)
    quotas = [min(c, lo) for c in counts]
    spare = cap - sum(quotas)
    for row, c in enumerate(counts):
        if spare and c > quotas[row]:
            quotas[row] += 1
            spare -= 1
    return quotas


def test_water_fill_equals_the_level_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        b = int(torch.randint(1, 10, (1,), generator=g))
        counts = torch.randint(0, [3, 20, 600][trial % 3], (b,), generator=g)
        for cap in (1, 2, 7, 31, int(counts.sum()) - 1, int(counts.sum()), 10_000):
            if cap >= 1:
                assert water_fill(counts, cap).tolist() == quotas_by_search(counts.tolist(), cap), (counts, cap)


def random_batch(g: torch.Generator, b: int, s: int):
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) < torch.rand(b, 1, generator=g)).long()
    loss_mask[torch.arange(s)[None] >= lengths[:, None]] = 0
    return loss_mask, lengths


def test_anchor_sampling_properties_on_random_batches():
    """Candidates only, sorted, valid first and padding 0, per-row counts = the quotas, width = the largest."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        b, s, bs = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(2, 90, (1,), generator=g)), 4
        loss_mask, lengths = random_batch(g, b, s)
        num_anchors, cap = [3, 10, 100][trial % 3], [0, 1, 9, 40][trial % 4]
        anchors, valid = sample_anchors(loss_mask, lengths, bs, num_anchors, torch.Generator().manual_seed(trial),
                                        max_total=cap)
        counts = [min(num_anchors, sum(1 for a in range(1, int(lengths[r]) - bs + 1) if loss_mask[r, a]))
                  for r in range(b)]
        quotas = quotas_by_search(counts, cap) if cap else counts
        assert valid.sum(1).tolist() == quotas
        assert anchors.shape == valid.shape == (b, max(1, max(quotas)))
        for r in range(b):
            picked = anchors[r][valid[r]].tolist()
            assert valid[r].tolist() == sorted(valid[r].tolist(), reverse=True)  # valid first
            assert picked == sorted(set(picked)) and anchors[r][~valid[r]].eq(0).all()
            assert all(a >= 1 and a + bs <= int(lengths[r]) and loss_mask[r, a] == 1 for a in picked)


def test_anchor_picks_are_uniform_over_the_candidates():
    """Over many seeds every candidate of a row is kept about equally often, capped or not."""
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], [1] * 16])
    lengths = torch.tensor([15, 16])  # row 0: candidates 1, 2, 4..11; row 1: 1..12 (block 4)
    seeds = 3000
    for num_anchors, cap, kept in ((3, 0, (3, 3)), (8, 9, (5, 4))):  # cap 9: 8 + 8 drawn, 5 + 4 kept
        hits = torch.zeros(2, 16)
        for seed in range(seeds):
            anchors, valid = sample_anchors(loss_mask, lengths, 4, num_anchors, torch.Generator().manual_seed(seed),
                                            max_total=cap)
            hits.scatter_add_(1, anchors, valid.float())
        for row, cands in ((0, [1, 2, *range(4, 12)]), (1, list(range(1, 13)))):
            expected = seeds * kept[row] / len(cands)
            assert hits[row].sum() == seeds * kept[row]
            assert ((hits[row, cands] - expected).abs() < 0.1 * expected).all(), (row, hits[row])


def test_block_inputs_and_labels():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    lm = torch.tensor([[0, 0, 1, 1, 0, 1]])
    anchors = torch.tensor([[1, 3]])
    valid = torch.tensor([[True, True]])
    blocks, labels, lv = block_inputs_and_labels(ids, lm, torch.tensor([6]), anchors, valid, 3, mask_token_id=99)
    assert blocks.tolist() == [[[11, 99, 99], [13, 99, 99]]]
    assert labels.tolist() == [[[12, 13], [14, 15]]]
    assert lv.tolist() == [[[True, True], [False, True]]]
