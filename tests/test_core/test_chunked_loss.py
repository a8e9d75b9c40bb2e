"""Chunked LM head + loss: the same loss, gradients and metrics as the whole-batch computation."""

from __future__ import annotations

import pytest
import torch

from dflash_ds.components.loss import (anchor_quotas, chunked_dflash_loss, dflash_loss, metric_sums,
                                       sample_anchors)

N, K, H, V = 13, 5, 16, 37


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g, dtype=torch.float64).float()
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    head.weight.requires_grad_(False)
    labels = torch.randint(0, V, (N, K), generator=g)
    valid = torch.rand(N, K, generator=g) > 0.25
    valid[3] = False  # a block with no valid position
    target_hidden = torch.randn(N, K, H, generator=g)
    return hidden, head, labels, valid, target_hidden


KNOBS = {
    "ce": {},
    "kl": {"kl_weight": 0.4, "kl_temperature": 1.7},
    "streak": {"streak_weight": 0.6},
    "kl+streak": {"kl_weight": 0.5, "kl_temperature": 0.8, "streak_weight": 0.3},
}


@pytest.mark.parametrize("knobs", list(KNOBS), ids=list(KNOBS))
@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])  # 13 blocks: 4 and 5 do not divide it, 13 and 64 are one chunk
def test_chunked_equals_whole(knobs, chunk):
    hidden, head, labels, valid, target_hidden = _case()
    kw = dict(KNOBS[knobs])
    use_kl = "kl_weight" in kw
    h1 = hidden.clone().requires_grad_(True)
    whole = dflash_loss(head(h1), labels, valid, gamma=3.0,
                        target_logits=head(target_hidden) if use_kl else None, **kw)
    whole.loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    chunked = chunked_dflash_loss(h2, head, labels, valid, gamma=3.0,
                                  target_hidden=target_hidden if use_kl else None, chunk_blocks=chunk, **kw)
    chunked.loss.backward()
    assert abs(chunked.loss.item() - whole.loss.item()) < 1e-5
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    assert h2.grad.abs().sum() > 0
    for a, b in zip(metric_sums(chunked).values(), metric_sums(whole).values()):
        assert torch.equal(a, b)
    assert torch.allclose(chunked.weight_sum, whole.weight_sum, atol=1e-5)


def test_chunked_grad_scales_with_upstream_and_no_grad_mode():
    hidden, head, labels, valid, _ = _case(1)
    h = hidden.clone().requires_grad_(True)
    (3.0 * chunked_dflash_loss(h, head, labels, valid, gamma=7.0, chunk_blocks=4).loss).backward()
    h_ref = hidden.clone().requires_grad_(True)
    (3.0 * dflash_loss(head(h_ref), labels, valid, gamma=7.0).loss).backward()
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-5)
    with torch.no_grad():
        out = chunked_dflash_loss(hidden, head, labels, valid, gamma=7.0, chunk_blocks=4)
    assert abs(out.loss.item() - dflash_loss(head(hidden), labels, valid, gamma=7.0).loss.item()) < 1e-6


def test_no_valid_position_gives_zero_loss_and_zero_grad():
    hidden, head, labels, _, _ = _case(2)
    h = hidden.clone().requires_grad_(True)
    out = chunked_dflash_loss(h, head, labels, torch.zeros(N, K, dtype=torch.bool), gamma=7.0, chunk_blocks=3)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.all(h.grad == 0)


def test_anchor_quotas_water_filling():
    assert anchor_quotas([5, 1, 9], 100) == [5, 1, 9]
    assert anchor_quotas([5, 1, 9], 9) == [4, 1, 4]
    assert anchor_quotas([5, 1, 9], 10) == [5, 1, 4]
    assert anchor_quotas([10, 10, 10], 8) == [3, 3, 2]
    assert anchor_quotas([0, 7], 3) == [0, 3]
    for counts, cap in (([3, 8, 2, 40, 11], 17), ([1] * 9, 4), ([100, 3], 50)):
        q = anchor_quotas(counts, cap)
        assert sum(q) == min(sum(counts), cap) and all(0 <= a <= c for a, c in zip(q, counts))
        cut = [a for a, c in zip(q, counts) if a < c]  # fair: a row that was cut has within one of any other row
        assert not cut or min(cut) >= max(q) - 1


def _mask_batch(seed: int, b: int = 6, s: int = 120):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, s + 1, (b,), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) > 0.3).long()
    loss_mask[torch.arange(s)[None] >= lengths[:, None]] = 0
    return loss_mask, lengths


def test_anchor_budget_is_never_exceeded_and_deterministic():
    for seed in range(20):
        loss_mask, lengths = _mask_batch(seed)
        for cap in (1, 7, 50, 200):
            a1, v1 = sample_anchors(loss_mask, lengths, 8, 40, torch.Generator().manual_seed(seed), max_total=cap)
            a2, v2 = sample_anchors(loss_mask, lengths, 8, 40, torch.Generator().manual_seed(seed), max_total=cap)
            assert torch.equal(a1, a2) and torch.equal(v1, v2)
            assert int(v1.sum()) <= cap
            uncapped, uv = sample_anchors(loss_mask, lengths, 8, 40, torch.Generator().manual_seed(seed))
            per_row = uv.sum(1).tolist()
            assert v1.sum(1).tolist() == anchor_quotas(per_row, cap)
            for row in range(loss_mask.shape[0]):  # a capped row keeps a subset of its uncapped picks
                assert set(a1[row][v1[row]].tolist()) <= set(uncapped[row][uv[row]].tolist())
            if sum(per_row) <= cap:  # a cap that does not bind changes nothing
                assert torch.equal(a1, uncapped) and torch.equal(v1, uv)


def test_capped_anchors_depend_on_the_seed():
    loss_mask, lengths = _mask_batch(0)
    a, _ = sample_anchors(loss_mask, lengths, 8, 40, torch.Generator().manual_seed(1), max_total=30)
    b, _ = sample_anchors(loss_mask, lengths, 8, 40, torch.Generator().manual_seed(2), max_total=30)
    assert not torch.equal(a, b)
